"""This machine's memory read bandwidth, measured the way a decode step reads its weights: one
pass over a buffer far larger than the caches (a float32 sum, vectorised by torch), with 1 and 2
threads; the best of a few passes."""

from __future__ import annotations

import time

import torch

BUFFER_BYTES = 1 << 30


def read_bandwidth(
    threads: tuple[int, ...] = (1, 2), nbytes: int = BUFFER_BYTES, repeats: int = 5
) -> dict:
    before = torch.get_num_threads()
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # ones: every page really mapped
    per_threads: dict[str, float] = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            buf.sum()  # first pass untimed: thread pool and TLB warm
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                buf.sum()
                best = min(best, time.perf_counter() - t0)
            per_threads[str(n)] = round(nbytes / best / 1e9, 2)
    finally:
        torch.set_num_threads(before)
        del buf
    return {
        "method": "torch float32 sum over a buffer, best of repeats",
        "buffer_bytes": nbytes,
        "repeats": repeats,
        "read_gb_s": per_threads,
        "best_gb_s": max(per_threads.values()),
    }
