"""Per-op thread counts on CPU: parallel only where the work pays for waking threads.

Waking a second OpenMP thread (passive wait policy, shared cores) costs more per parallel region
than a whole decode-sized RMSNorm, rotary or small GEMM takes on one thread (figures:
docs/PERFORMANCE.md#thread-wake-ups). Inside `split_threads` every
op runs single-threaded unless its caller asks for the full count (`all_threads`, or
`threads_for` by work size): the engine's GEMMs and big attention calls do, the elementwise glue of
the model does not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_state = threading.local()  # OpenMP's thread count is per calling thread, so is this state


@contextmanager
def split_threads(threads: int) -> Iterator[None]:
    """Run the body single-threaded by default; `threads_for` grants ``threads`` to big ops."""
    if threads <= 1 or getattr(_state, "threads", 0):  # nothing to split, or already inside
        yield
        return
    previous = torch.get_num_threads()
    _state.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _state.threads = 0
        torch.set_num_threads(previous)


def threads_for(work: float, threshold: float) -> int:
    """Threads to set around an op of ``work`` units (0: leave the count alone).

    Inside `split_threads`, returns the full count when work >= threshold; the caller sets it
    with torch.set_num_threads and restores 1 afterwards (`release`), or lets `threads_by_work`
    do both around a block.
    """
    threads = getattr(_state, "threads", 0)
    return threads if threads and work >= threshold else 0


@contextmanager
def threads_by_work(work: float, threshold: float) -> Iterator[None]:
    """The body on `threads_for`'s count (set, then `release`d), for torch ops of ``work`` units."""
    threads = threads_for(work, threshold)
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        release(threads)


def all_threads() -> int:
    """Threads to set around an op that always runs parallel (0 outside `split_threads`)."""
    return getattr(_state, "threads", 0)


def release(threads: int) -> None:
    """Back to one thread after an op that `threads_for` parallelised."""
    if threads:
        torch.set_num_threads(1)
