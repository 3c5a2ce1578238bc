"""Where an engine's start-up time goes: named phases, timed once each, logged when it is ready
and reported in /status (``startup_s``), so that a slow start names its cause (imports, tokenizer,
weights, kernels, probes) instead of only its total. While it loads, /status also says which
phase runs now (``stage``: the innermost, with its percent where it counts one, as the weights
do), so that a supervisor can show how far a start has got."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

# The process's own clock at its first line (engine/__main__.py sets it): imports count too.
_started = time.monotonic()
_phases: dict[str, float] = {}


@dataclass
class _Running:
    name: str
    began: float
    percent: float | None = None


# The phases running now, outermost first: entered on the engine's loading thread, read on the
# event loop (a list's append, pop and copy are atomic under the GIL).
_running: list[_Running] = []
_between_since = time.monotonic()  # when the last phase ended (or the load did)
_loaded = False


def mark_process_start(at: float) -> None:
    global _started, _between_since
    _started = _between_since = at


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Times the block as phase ``name`` (added to the time already under that name)."""
    global _between_since
    running = _Running(name, time.monotonic())
    _running.append(running)
    try:
        yield
    finally:
        _running.remove(running)
        _between_since = time.monotonic()
        _phases[name] = _phases.get(name, 0.0) + _between_since - running.began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Loading a model creates hundreds of thousands of objects that live as long as the process
    (a vocabulary's strings, the model's modules, tensors): the cyclic collector would walk them
    all again at each of its full passes during the load (0.4 s of a first Gemma start) and at
    every full pass while serving. It is paused for the block; then one collection of what the
    block allocated (the youngest generation: nothing was promoted meanwhile; the imports before
    it are not walked again), and what survived is frozen out of every later pass, as an engine
    template does with its imports."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        with phase("garbage collection"):
            gc.collect(0)
            gc.freeze()
        if enabled:
            gc.enable()


def progress(done: int, total: int) -> None:
    """How far the innermost phase running has got: ``done`` of ``total`` steps."""
    running = _running[-1:]
    if running and total > 0:
        running[0].percent = round(100.0 * min(done, total) / total, 1)


def record(name: str, seconds: float) -> None:
    _phases[name] = _phases.get(name, 0.0) + seconds


def mark_loaded() -> None:
    global _loaded, _between_since
    _loaded, _between_since = True, time.monotonic()


def since_start() -> float:
    return time.monotonic() - _started


def phases() -> dict[str, float]:
    """Seconds per phase, in the order they first ran."""
    return dict(_phases)


def stage() -> dict[str, object]:
    """Where the start is now: the innermost phase running (``loading`` between two, ``ready``
    once loaded), its percent where it counts one, seconds in it and since the process began."""
    running = list(_running)
    now = time.monotonic()
    if _loaded:
        name, percent, since = "ready", None, _between_since
    elif running:
        name, percent, since = running[-1].name, running[-1].percent, running[-1].began
    else:
        name, percent, since = "loading", None, _between_since
    return {
        "stage": name,
        "percent": percent,
        "stage_s": round(now - since, 3),
        "since_start_s": round(now - _started, 3),
    }


def summary() -> str:
    return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in _phases.items())
