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


def check_attention_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """The query is read through its strides; both cache pools through K's (one layout, packed)."""
    check_last_dim_contiguous(query)
    if k_cache.stride() != v_cache.stride() or not k_cache.is_contiguous():
        raise ValueError("K and V cache pools must be contiguous and of the same layout")


@triton.jit
def scaled_scores(scores, scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k scores -> log2-domain logits: scale, optional tanh soft cap, times log2(e)."""
    scores = scores * scale
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both tails (exp overflow gives 1, underflow -1).
        capped = scores / softcap
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))
    return scores * 1.4426950408889634


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table,
    pos,
    valid,
    kv_head,
    d,
    d_mask,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V rows of one KV head at context positions `pos`, found through the block table;
    invalid positions (and padded head dims) read as 0."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    kv_off = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
    kv_off += kv_head * stride_cache_head
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def tile_scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 query rows x one K tile -> log2-domain logits (before masking)."""
    scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    return scaled_scores(scores, scale, softcap, USE_SOFTCAP)


@triton.jit
def online_softmax_update(scores, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one masked tile of log2-domain scores and its V rows into the running max, sum and
    unnormalised output; returns the new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    return m_new, l_i, acc
