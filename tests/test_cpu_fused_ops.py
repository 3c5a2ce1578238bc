"""The lean forward's fused C ops against the torch ops they replace (and the torch fallback)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.cpu_kernels.fused_ops import FusedOps
from engine.cpu_threads import split_threads

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_add_rms_norm_matches_torch(rows: int, with_delta: bool, split: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator) * 3
    delta = torch.randn(rows, 576, generator=generator) if with_delta else None
    weight = torch.randn(576, generator=generator)
    expected_x = x + delta if with_delta else x.clone()
    expected = F.rms_norm(expected_x, (576,), weight, 1e-5)
    kernel, fallback = (
        FusedOps(torch.float32, torch.device("cpu")),
        FusedOps(torch.bfloat16, x.device),
    )
    assert kernel.uses_kernels and not fallback.uses_kernels
    x_kernel, x_torch = x.clone(), x.clone()
    with split_threads(2) if split else contextlib.nullcontext():
        got = kernel.add_rms_norm(x_kernel, delta, weight, 1e-5)
    torch.testing.assert_close(x_kernel, expected_x)  # the residual stream is updated in place
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_torch_ops().add_rms_norm(x_torch, delta, weight, 1e-5), expected)
    torch.testing.assert_close(x_torch, expected_x)


@pytest.mark.parametrize("tokens", [1, 7, 200])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_rotates_q_and_k_heads_in_place_and_leaves_v(tokens: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(tokens + head_dim)
    heads, v_heads = 12, 3
    qkv = torch.randn(tokens, (heads + v_heads) * head_dim, generator=generator)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    expected = rotate_reference(qk, cos, sin)
    v_before = qkv[:, heads * head_dim :].clone()
    for ops in (FusedOps(torch.float32, torch.device("cpu")), _torch_ops()):
        work = qkv.clone()
        got = ops.rope(work, ops.rotary_tables(cos, sin), heads, head_dim)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(work[:, heads * head_dim :], v_before)


def _torch_ops() -> FusedOps:
    """The torch fallback, in fp32."""
    ops = FusedOps(torch.float32, torch.device("cpu"))
    ops._lib = None
    return ops
