"""What the event loop asks of the engine thread (engine.serving.async_engine), as typed values in
one queue: the thread applies them in order between two steps."""

from __future__ import annotations

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


EngineCommand = AddRequest | AbortRequest
