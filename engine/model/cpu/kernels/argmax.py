"""The sampler's greedy argmax over logits rows as one C call (fused_ops.c)."""

from __future__ import annotations

import torch

from engine.model.cpu.kernels.build import DTYPE_SUFFIXES, load

# Logits from which argmax_rows splits rows over threads: below, waking a thread costs more than
# the split saves (figures: docs/PERFORMANCE.md#thread-wake-ups).
_ARGMAX_PARALLEL = 1 << 18


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """Each row's first index of its largest value (of its first NaN, if any), as
    ``x.max(dim=-1).indices`` gives it; None when x is not a contiguous fp32/bf16 CPU matrix or
    the kernels are unavailable: the caller uses torch."""
    suffix = DTYPE_SUFFIXES.get(x.dtype)
    lib = load() if suffix and x.device.type == "cpu" else None
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    threads = torch.get_num_threads() if rows > 1 and x.numel() >= _ARGMAX_PARALLEL else 1
    getattr(lib, "argmax_rows_" + suffix)(x.data_ptr(), out.data_ptr(), rows, cols, threads)
    return out.tolist()
