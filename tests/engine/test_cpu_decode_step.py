"""The fused decode step (paged_decode.DecodeStep) against torch: K/V cache writes from
strided qkv rows, rotary applied in the step, and the qkv panel GEMM run in the attention's
parallel region, bit for bit, its time reported only when asked (narrow-weight layers:
test_cpu_narrow_decode)."""

from __future__ import annotations

import time

import pytest
import torch

from engine.model.attention import torch_reference
from engine.model.attention.torch_reference import write_kv_cache_torch
from engine.model.cpu.kernels import build, paged_decode, panel_gemm
from tests.engine.test_attention import make_batch
from tests.engine.test_cpu_decode_kernel import ATOL, RAGGED
from tests.engine.test_cpu_fused_ops import rotate_reference

pytestmark = pytest.mark.skipif(
    not build.available(), reason="no C compiler: the kernel cannot be built here"
)


def test_c_cache_write_matches_index_copy_for_strided_rows() -> None:
    """K and V arrive as strided views of the fused qkv rows; slots are scattered."""
    if not build.available():
        pytest.skip("no C compiler")
    generator = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, head_dim = 5, 6, 2, 8
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator)
    key = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, -1)
    value = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([37, 2, 16, 63, 0])
    caches = [torch.zeros(4, 16, kv_heads, head_dim) for _ in range(4)]
    assert paged_decode.write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_torch(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    narrow = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    assert not paged_decode.write_kv_cache(key, value, narrow, narrow.clone(), slots)
    assert not narrow.any()  # refused: nothing written, the torch path converts instead


@pytest.mark.parametrize(
    ("act_dtype", "kv_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize(("seq_lens", "threads"), [(RAGGED, 2), (RAGGED, 1), ([40, 3], 2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_fused_decode_step_rotates_writes_and_attends(
    act_dtype, kv_dtype, seq_lens, threads, window, head_dim
):
    """DecodeStep with slots and rotary tables, on unrotated qkv rows, against rotating q/k in
    fp32 torch, writing K/V with index_copy and attending on the torch path."""
    q_heads, kv_heads = 9, 3
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=16, seed=len(seq_lens) + head_dim,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(7)
    angles = torch.rand(len(seq_lens), head_dim // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(act_dtype), angles.sin().to(act_dtype)
    query, key, value = (t.to(act_dtype) for t in (batch.query, batch.key, batch.value))
    qkv = torch.cat([t.reshape(len(seq_lens), -1) for t in (query, key, value)], dim=-1)
    k_cache, v_cache = batch.k_cache.to(kv_dtype), batch.v_cache.to(kv_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    rotated_k = rotate_reference(key.float(), cos.float(), sin.float())
    slots = batch.meta.slot_mapping
    write_kv_cache_torch(rotated_k, value.float(), expected_k, expected_v, slots)
    expected = torch_reference.attend_torch(
        rotate_reference(query.float(), cos.float(), sin.float()), expected_k.float(),
        expected_v.float(), batch.meta, head_dim**-0.5, window, None,
    )  # fmt: skip
    step = paged_decode.DecodeStep(
        batch.meta.block_tables, batch.meta.seq_lens, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=16, kv_dtype=kv_dtype, num_threads=threads,
        act_dtype=act_dtype, slots=slots, rotary=(cos, sin),
    )  # fmt: skip
    out = step(qkv, k_cache, v_cache, head_dim**-0.5, window, None)
    assert out.dtype == act_dtype
    # bf16: the written key may round the other way where the two rotations differ in fp32
    tolerance = 1e-6 if kv_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(k_cache, expected_k, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(v_cache, expected_v)
    tolerance = ATOL if act_dtype == torch.float32 else 1e-2  # bf16 output: one rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


NO_PANELS = panel_gemm.pack(torch.zeros(1, 1)) is None


@pytest.mark.skipif(NO_PANELS, reason="no AVX-512: no panel GEMM here")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("step_threads", "gemm_threads"), [(2, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_projection_in_the_attention_region_equals_the_two_calls(
    kv_dtype, step_threads, gemm_threads, bias
):
    """A DecodeStep call given the qkv panel GEMM (run with the attention in one parallel region)
    writes the same qkv rows, K/V slots and output as the GEMM followed by a call on its rows,
    bit for bit; attention sized for one thread included."""
    q_heads, kv_heads, head_dim, hidden = 9, 3, 64, 96
    batch = make_batch(
        [1] * len(RAGGED), RAGGED, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=16, seed=3,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    width = (q_heads + 2 * kv_heads) * head_dim
    weight = torch.randn(width, hidden, generator=generator) * hidden**-0.5
    b = torch.randn(width, generator=generator) if bias else None
    x = torch.randn(len(RAGGED), hidden, generator=generator)
    angles = torch.rand(len(RAGGED), head_dim // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    packed = panel_gemm.pack(weight)
    qkv = panel_gemm.linear(x, packed, width, b, gemm_threads)
    operands = (x, packed, width, b, torch.full_like(qkv, float("nan")), gemm_threads)
    caches = [batch.k_cache.to(kv_dtype), batch.v_cache.to(kv_dtype)]
    expected_caches = [c.clone() for c in caches]
    step = paged_decode.DecodeStep(
        batch.meta.block_tables, batch.meta.seq_lens, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=16, kv_dtype=kv_dtype, num_threads=step_threads,
        slots=batch.meta.slot_mapping, rotary=(angles.cos(), angles.sin()),
    )  # fmt: skip
    expected = step(qkv, *expected_caches, head_dim**-0.5, None, None).clone()
    out = step(operands, *caches, head_dim**-0.5, None, None)
    assert torch.equal(operands[-2], qkv)  # the rows the call's GEMM wrote
    assert torch.equal(out, expected)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches, strict=True))


@pytest.mark.skipif(NO_PANELS, reason="no AVX-512: no panel GEMM here")
@pytest.mark.parametrize("time_projection", [True, False])
def test_projection_time_is_written_only_when_asked(time_projection):
    """With time_projection, a call given the qkv panel GEMM reports the projection's time (part
    of the call's); without, the kernel leaves it alone (the step profile off)."""
    q_heads, kv_heads, head_dim, hidden = 9, 3, 64, 96
    batch = make_batch(
        [1] * len(RAGGED), RAGGED, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=16, seed=3,
    )  # fmt: skip
    width = (q_heads + 2 * kv_heads) * head_dim
    packed = panel_gemm.pack(torch.randn(width, hidden))
    x, rows = torch.randn(len(RAGGED), hidden), torch.empty(len(RAGGED), width)
    angles = torch.rand(len(RAGGED), head_dim)
    step = paged_decode.DecodeStep(
        batch.meta.block_tables, batch.meta.seq_lens, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=16, kv_dtype=torch.float32, num_threads=2,
        slots=batch.meta.slot_mapping, rotary=(angles.cos(), angles.sin()),
        time_projection=time_projection,
    )  # fmt: skip
    started = time.perf_counter()
    step((x, packed, width, None, rows, 2), batch.k_cache, batch.v_cache, 0.125, None, None)
    call_s = time.perf_counter() - started
    if time_projection:
        assert 0 < step.projection_s <= call_s
    else:
        assert step.projection_s == 0.0
