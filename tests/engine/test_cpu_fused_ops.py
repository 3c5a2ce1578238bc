"""The lean forward's fused C ops against the torch ops they replace (and the torch fallback)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu.kernels.argmax import argmax_rows
from engine.model.cpu.kernels.build import available
from engine.model.cpu.kernels.fused_ops import FusedOps, StepOps
from engine.model.cpu.threads import split_threads

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler")


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# (rtol, atol): fp32 reorders a sum; bf16 rounds each result once (one bf16 ulp is 2**-8).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 8e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_add_rms_norm_matches_torch(
    dtype: torch.dtype, rows: int, with_delta: bool, split: bool
) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=generator).to(dtype) if with_delta else None
    weight = torch.randn(576, generator=generator).to(dtype)
    # fp32 math on the same inputs, the residual rounded to the dtype as the model's add is
    expected_x = (x.float() + delta.float()).to(dtype) if with_delta else x.clone()
    expected = F.rms_norm(expected_x.float(), (576,), weight.float(), 1e-5)
    kernel = FusedOps(dtype, torch.device("cpu"))
    assert kernel.uses_kernels
    x_kernel, x_torch = x.clone(), x.clone()
    with split_threads(2) if split else contextlib.nullcontext():
        got = kernel.add_rms_norm(x_kernel, delta, weight, 1e-5)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(x_kernel, expected_x)  # the residual stream is updated in place
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol)
    fallback = _torch_ops(dtype).add_rms_norm(x_torch, delta, weight, 1e-5)
    # torch's bf16 RMSNorm rounds in between: a few bf16 ulps
    torch.testing.assert_close(fallback.float(), expected, rtol=4 * rtol, atol=4 * atol)
    torch.testing.assert_close(x_torch, expected_x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 200])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_rotates_q_and_k_heads_in_place_and_leaves_v(
    dtype: torch.dtype, tokens: int, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(tokens + head_dim)
    heads, v_heads = 12, 3
    qkv = torch.randn(tokens, (heads + v_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    expected = rotate_reference(qk.float(), cos.float(), sin.float())
    v_before = qkv[:, heads * head_dim :].clone()
    rtol, atol = TOLERANCE[dtype]
    kernel = FusedOps(dtype, torch.device("cpu"))
    assert kernel.uses_kernels
    for ops in (kernel, _torch_ops(dtype)):
        work = qkv.clone()
        got = ops.rope(work, ops.rotary_tables(cos, sin), heads, head_dim)
        assert got.dtype == dtype
        # torch's bf16 ops round after each op: up to a few bf16 ulps of the largest term
        bound = (rtol, atol) if ops.uses_kernels else (4 * rtol, 4 * atol)
        torch.testing.assert_close(got.float(), expected, rtol=bound[0], atol=bound[1])
        torch.testing.assert_close(work[:, heads * head_dim :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 70])
@pytest.mark.parametrize("split", [False, True])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, split: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=generator) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, float("nan")])  # saturated, zero, NaN
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up  # fp32 math on the same inputs
    rtol, atol = TOLERANCE[dtype]
    residual = torch.zeros(rows, 576, dtype=dtype)
    with split_threads(2) if split else contextlib.nullcontext():
        step_ops = StepOps(FusedOps(dtype, torch.device("cpu")), residual, 1536)
        got = step_ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (rows, 1536)
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol, equal_nan=True)
    fallback = StepOps(_torch_ops(dtype), residual, 1536).silu_mul(gate_up)
    torch.testing.assert_close(
        fallback.float(), expected, rtol=4 * rtol, atol=4 * atol, equal_nan=True
    )


def _torch_ops(dtype: torch.dtype = torch.float32) -> FusedOps:
    """The torch fallback."""
    ops = FusedOps(dtype, torch.device("cpu"))
    ops._lib = None
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 7), (5, 300), (64, 49152)])
def test_argmax_rows_is_torch_max_index(dtype: torch.dtype, rows: int, cols: int) -> None:
    """First index of the largest value, as torch.max(dim=-1) answers, ties, -inf and NaN rows
    included; on one thread and split over rows."""
    if not available():
        pytest.skip("no C compiler")
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, cols, generator=generator) * 4).to(dtype)
    x[0, cols // 2] = x[0, cols - 1] = x[0].max() + 1  # a tie
    if rows > 2:
        x[1] = float("-inf")
        x[2, 3] = float("nan")  # NaN wins, as in torch
        x[2, cols - 1] = float("nan")
    assert argmax_rows(x) == x.max(dim=-1).indices.tolist()
    narrower = x[:, :-1]  # not contiguous (but for one row): the caller uses torch
    expected = None if rows > 1 else narrower.max(dim=-1).indices.tolist()
    assert argmax_rows(narrower) == expected
