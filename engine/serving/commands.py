"""What the event loop asks of the engine thread (engine.serving.engine_thread), as typed values
in one queue: the thread applies them in order between two steps."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Hand a request to the core (its admission comes back to the event loop)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() when the server accepted it


@dataclass(frozen=True)
class AbortRequest:
    """Drop a request from the core (a no-op once it has finished there)."""

    request_id: str


@dataclass(frozen=True)
class Sleep:
    """Release the weights and KV cache (EngineCore.sleep); ``done`` gets its outcome."""

    done: Future


@dataclass(frozen=True)
class WakeUp:
    """Bring them back (EngineCore.wake_up); ``done`` gets its outcome."""

    done: Future


EngineCommand = AddRequest | AbortRequest | Sleep | WakeUp
