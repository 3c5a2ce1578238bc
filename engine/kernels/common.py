"""Helpers shared by the Triton attention kernels and their launchers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 (CPU tests) tiles are kept small so that short test sequences still run
# several iterations of every loop; on a GPU they are sized for occupancy.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def padded_dim(n: int) -> int:
    """Next power of two, at least 16 (tl.dot's minimum tile edge)."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision; fp16/bf16 values upcast to fp32 are exact in tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("attention kernels need a unit stride on the head dimension")


@triton.jit
def scaled_scores(scores, scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k scores -> log2-domain logits: scale, optional tanh soft cap, times log2(e)."""
    scores = scores * scale
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both tails (exp overflow gives 1, underflow -1).
        capped = scores / softcap
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))
    return scores * 1.4426950408889634
