"""Where an engine's start-up time goes: named phases, timed once each, logged when it is ready
and reported in /status (``startup``), so that a slow start names its cause (imports, tokenizer,
weights, kernels, probes) instead of only its total."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# The process's own clock at its first line (engine/__main__.py sets it): imports count too.
_started = time.monotonic()
_phases: dict[str, float] = {}


def mark_process_start(at: float) -> None:
    global _started
    _started = at


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Times the block as phase ``name`` (added to the time already under that name)."""
    began = time.monotonic()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.monotonic() - began


def record(name: str, seconds: float) -> None:
    _phases[name] = _phases.get(name, 0.0) + seconds


def since_start() -> float:
    return time.monotonic() - _started


def phases() -> dict[str, float]:
    """Seconds per phase, in the order they first ran."""
    return dict(_phases)


def summary() -> str:
    return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in _phases.items())
