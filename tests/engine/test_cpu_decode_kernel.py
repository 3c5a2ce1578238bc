"""The fused C decode kernel against the torch path and a naive per-sequence reference."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from engine.model.attention import torch_reference
from engine.model.attention.backends import BACKEND_ENV, paged_attention, select_backend
from engine.model.attention.torch_reference import write_kv_cache_torch
from engine.model.cpu.kernels import build, paged_decode, panel_gemm
from tests.engine.test_attention import PagedBatch, make_batch, reference_attention
from tests.engine.test_cpu_fused_ops import rotate_reference

torch.set_num_threads(2)

pytestmark = pytest.mark.skipif(
    not build.available(), reason="no C compiler: the kernel cannot be built here"
)

RAGGED = [1, 15, 16, 17, 130, 600]  # 600: three of the kernel's 256-key chunks
ATOL = 1e-5


def naive_decode(
    batch: PagedBatch, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    """One query per sequence; its visible keys looked up one by one through its block table,
    then per query head a max-subtracted softmax, in float64."""
    q_heads = batch.query.shape[1]
    block_size, kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for b, table in enumerate(batch.block_tables):
        seq_len = batch.meta.seq_lens_cpu[b]
        visible = [j for j in range(seq_len) if not window or j > seq_len - 1 - window]
        slots = [(table[j // block_size], j % block_size) for j in visible]
        keys = torch.stack([batch.k_cache[blk, off] for blk, off in slots]).double()
        values = torch.stack([batch.v_cache[blk, off] for blk, off in slots]).double()
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            scores = (keys[:, kv] @ batch.query[b, h].double()) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights / weights.sum()) @ values[:, kv]
    return out


def decode_batch(
    q_heads: int, kv_heads: int, head_dim: int, seed: int = 0, block_size: int = 16
) -> PagedBatch:
    """Ragged decode batch with shuffled block tables; the current token's K/V already written."""
    batch = make_batch(
        [1] * len(RAGGED), RAGGED, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, seed=seed,
    )  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    return batch


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (20, None), (300, None), (None, 5.0), (8, 2.0)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_references(q_heads, kv_heads, head_dim, window, softcap, threads):
    batch = decode_batch(q_heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_decode.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
        scale, window, softcap, threads,
    )  # fmt: skip
    torch_out = torch_reference.attend_torch(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap
    )
    torch.testing.assert_close(out, torch_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference_attention(batch, scale, window, softcap),
                               atol=ATOL, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(out.double(), naive_decode(batch, scale, window, softcap),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("block_size", [8, 24, 32])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("window", [None, 300])
def test_kernel_with_other_block_sizes(block_size, head_dim, window):
    """Tiles stop at block ends and at the kernel's 16-aligned chunk ends, whatever the block."""
    batch = decode_batch(9, 3, head_dim, seed=block_size, block_size=block_size)
    out = paged_decode.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
        0.125, window, None, 2,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), naive_decode(batch, 0.125, window, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


def test_kernel_reads_a_strided_table_and_a_non_contiguous_query():
    """Table rows with padding beyond max_blocks (a column slice) and a head-major query view."""
    batch = decode_batch(9, 3, 64, seed=3)
    max_blocks = batch.meta.block_tables.shape[1]
    wide = torch.full((len(RAGGED), max_blocks + 7), 10**6, dtype=torch.int32)
    wide[:, :max_blocks] = batch.meta.block_tables
    table_view = wide[:, :max_blocks]
    query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    out = paged_decode.paged_decode_attention(
        query, batch.k_cache, batch.v_cache, table_view, batch.meta.seq_lens, 0.125, None, None, 2
    )
    torch.testing.assert_close(out.double(), reference_attention(batch, 0.125, None, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


def test_kernel_rejects_what_it_does_not_support():
    batch = decode_batch(4, 2, 24)
    args = (batch.meta.block_tables, batch.meta.seq_lens, 0.2, None, None, 1)
    assert not paged_decode.supports(batch.query.half(), batch.k_cache)
    with pytest.raises(TypeError):
        paged_decode.paged_decode_attention(
            batch.query.double(), batch.k_cache, batch.v_cache, *args
        )
    with pytest.raises(ValueError):
        paged_decode.paged_decode_attention(
            batch.query, batch.k_cache.transpose(1, 2), batch.v_cache, *args
        )
    with pytest.raises(TypeError):
        paged_decode.paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables.long(),
            *args[1:],
        )  # fmt: skip


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 4.0)])
def test_mixed_batch_through_paged_attention(window, softcap, monkeypatch):
    """Decode rows interleaved with prefills: the decode group runs the kernel, prefills torch."""
    query_lens, seq_lens = [1, 1, 7, 1, 13, 2, 1], [9, 30, 7, 1, 40, 3, 130]
    calls = []
    real = paged_decode.paged_decode_attention
    monkeypatch.setattr(
        paged_decode, "paged_decode_attention", lambda *a: calls.append(a[0].shape) or real(*a)
    )
    outs = {}
    for backend in ("cpu", "torch"):
        batch = make_batch(query_lens, seq_lens, q_heads=9, kv_heads=3, head_dim=64, seed=5)
        outs[backend] = paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
            scale=0.125, sliding_window=window, softcap=softcap, backend=backend,
        )  # fmt: skip
    assert calls == [torch.Size([4, 9, 64])]  # only the four decode rows, only with "cpu"
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=ATOL, rtol=1e-5)
    expected = reference_attention(batch, 0.125, window, softcap)
    torch.testing.assert_close(outs["cpu"].double(), expected, atol=ATOL, rtol=1e-5)


def test_auto_backend_on_cpu_uses_the_kernel(monkeypatch):
    """The backend chosen for a CPU model (select_backend, as the runner calls it at load) runs
    the kernel; $MODELYARD_ATTENTION_BACKEND=torch chooses the reference path instead."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    calls = []
    real = paged_decode.paged_decode_attention
    monkeypatch.setattr(
        paged_decode, "paged_decode_attention", lambda *a: calls.append(1) or real(*a)
    )
    batch = make_batch([1, 1], [5, 17], q_heads=4, kv_heads=2, head_dim=16)
    out = paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                          batch.meta, scale=0.25,
                          backend=select_backend(batch.query.device))  # fmt: skip
    assert calls == [1]
    torch.testing.assert_close(out.double(), reference_attention(batch, 0.25, None, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip
    monkeypatch.setenv(BACKEND_ENV, "torch")  # the reference path, kernel untouched
    paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                    batch.meta, scale=0.25,
                    backend=select_backend(batch.query.device))  # fmt: skip
    assert calls == [1]


def test_single_libgomp_shared_with_torch():
    """The kernel links libgomp.so.1 by soname: torch's copy, already mapped, is reused."""
    build.load()
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path: Path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    build.reset()
    try:
        batch = make_batch([1, 4, 1], [9, 4, 20], q_heads=4, kv_heads=2, head_dim=16)
        with caplog.at_level(logging.WARNING, logger="engine.model.cpu.kernels.build"):
            for backend in (select_backend(batch.query.device), "cpu"):
                out = paged_attention(
                    batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                    batch.meta, scale=0.25, backend=backend,
                )  # fmt: skip
                torch.testing.assert_close(
                    out.double(), reference_attention(batch, 0.25, None, None), atol=ATOL,
                    rtol=1e-5,
                )  # fmt: skip
        warnings = [r for r in caplog.records if r.name == "engine.model.cpu.kernels.build"]
        assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
        assert build.load() is None
    finally:
        build.reset()


def test_builds_unused_for_weeks_are_removed(monkeypatch, tmp_path: Path):
    """A new build removes builds that no process loaded for _STALE_AFTER_S; loading a build
    marks it used."""
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "cpu_kernels"
    folder.mkdir()
    stale, recent = folder / "cpu_kernels-stale.so", folder / "cpu_kernels-recent.so"
    stale.write_bytes(b"")
    recent.write_bytes(b"")
    weeks_ago = time.time() - build._STALE_AFTER_S - 3600
    os.utime(stale, (weeks_ago, weeks_ago))
    built = build._build(["cc"])
    assert built.exists() and recent.exists() and not stale.exists()
    os.utime(built, (weeks_ago, weeks_ago))
    assert build._build(["cc"]) == built  # found, not rebuilt: marked used
    assert built.stat().st_mtime > time.time() - 60


def test_peaked_scores_and_nan_rows():
    """Scores hundreds apart (exp underflows to 0) still match; a NaN query head gives NaN in that
    head only, as the torch path does."""
    batch = decode_batch(9, 3, 64, seed=11)
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens)
    out = paged_decode.paged_decode_attention(batch.query, *args, 4.0, None, None, 1)
    torch.testing.assert_close(out.double(), naive_decode(batch, 4.0, None, None), atol=ATOL,
                               rtol=1e-5)  # fmt: skip
    batch.query[2, 4, 7] = float("nan")
    out = paged_decode.paged_decode_attention(batch.query, *args, 0.125, None, None, 1)
    nan = torch.zeros(out.shape, dtype=torch.bool)
    nan[2, 4] = True
    assert torch.equal(out.isnan(), nan)
    torch_out = torch_reference.attend_torch(batch.query, *args[:2], batch.meta, 0.125, None, None)
    assert torch.equal(torch_out.isnan(), nan)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 5.0)])
def test_bf16_pools(window, softcap):
    """bf16 K/V are widened exactly: an fp32 query matches the float64 reference of the same bf16
    values tightly; a bf16 query returns bf16 within bf16 rounding."""
    batch = make_batch([1] * len(RAGGED), RAGGED, q_heads=9, kv_heads=3, head_dim=64,
                       block_size=16, dtype=torch.bfloat16, seed=2)  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens, 0.125)
    expected = reference_attention(batch, 0.125, window, softcap)  # float64 of the bf16 values
    out = paged_decode.paged_decode_attention(batch.query.float(), *args, window, softcap, 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)
    out = paged_decode.paged_decode_attention(batch.query, *args, window, softcap, 1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


def test_bf16_mixed_batch_through_paged_attention():
    query_lens, seq_lens = [1, 9, 1, 1], [40, 9, 1, 17]
    outs = {}
    for backend in ("cpu", "torch"):
        batch = make_batch(query_lens, seq_lens, q_heads=9, kv_heads=3, head_dim=64,
                           dtype=torch.bfloat16, seed=4)  # fmt: skip
        outs[backend] = paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
            scale=0.125, backend=backend,
        )  # fmt: skip
    expected = reference_attention(batch, 0.125, None, None).to(torch.bfloat16)
    for out in outs.values():  # prefill rows are computed in bf16 by torch: looser atol
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_sequences_split_by_kv_head(q_heads, kv_heads, dtype):
    """Fewer sequences than twice the threads: the kernel splits each by KV head."""
    batch = make_batch([1, 1], [130, 17], q_heads=q_heads, kv_heads=kv_heads, head_dim=24,
                       block_size=16, dtype=dtype, seed=9)  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    expected = reference_attention(batch, 0.2, 50, None)
    for threads in (1, 2, 3):
        out = paged_decode.paged_decode_attention(
            batch.query.float(), batch.k_cache, batch.v_cache, batch.meta.block_tables,
            batch.meta.seq_lens, 0.2, 50, None, threads,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)


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


@pytest.mark.skipif(
    panel_gemm.pack(torch.zeros(1, 1)) is None, reason="no AVX-512: no panel GEMM here"
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("step_threads", "gemm_threads"), [(2, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_projection_in_the_attention_region_equals_the_two_calls(
    kv_dtype, step_threads, gemm_threads, bias
):
    """A DecodeStep call given the qkv panel GEMM (run with the attention in one parallel region)
    writes the same qkv rows, K/V slots and output as the GEMM followed by a call on its rows, bit
    for bit; attention sized for one thread included."""
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
    caches = [batch.k_cache.to(kv_dtype), batch.v_cache.to(kv_dtype)]
    expected_caches = [c.clone() for c in caches]
    step = paged_decode.DecodeStep(
        batch.meta.block_tables, batch.meta.seq_lens, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=16, kv_dtype=kv_dtype, num_threads=step_threads,
        slots=batch.meta.slot_mapping, rotary=(angles.cos(), angles.sin()),
    )  # fmt: skip
    qkv = panel_gemm.linear(x, packed, width, b, gemm_threads)
    expected = step(qkv, *expected_caches, head_dim**-0.5, None, None).clone()
    rows = torch.full_like(qkv, float("nan"))
    out = step((x, packed, width, b, rows, gemm_threads), *caches, head_dim**-0.5, None, None)
    assert torch.equal(rows, qkv)
    assert torch.equal(out, expected)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches, strict=True))


@pytest.mark.skipif(
    panel_gemm.pack(torch.zeros(1, 1)) is None, reason="no AVX-512: no panel GEMM here"
)
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


def _xor_words(rows: torch.Tensor) -> int:
    """XOR of a tensor's bytes taken as little-endian 64-bit words."""
    words = rows.contiguous().view(torch.uint8).view(-1, 8).to(torch.int64)
    word = (words << (8 * torch.arange(8))).sum(dim=1)  # wraps like uint64 in two's complement
    mix = 0
    for value in word.tolist():
        mix ^= value & (2**64 - 1)
    return mix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_paged_kv_reads_exactly_the_visible_rows(dtype, threads):
    """The benchmark's attention floor reads each sequence's rows [0, seq_len) of every layer's
    pools through its table, no more (rows past seq_len hold data that would change the XOR)."""
    generator = torch.Generator().manual_seed(0)
    layers, blocks, block_size, kv_heads, head_dim = 3, 24, 4, 2, 8
    caches = [
        tuple(
            torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    seq_lens = torch.tensor([1, 4, 5, 11, 0], dtype=torch.int32)
    order = torch.randperm(blocks, generator=generator).to(torch.int32)
    tables = torch.stack([order[i * 4 : i * 4 + 4] for i in range(len(seq_lens))])
    expected = 0
    for k_cache, v_cache in caches:
        for table, seq_len in zip(tables.tolist(), seq_lens.tolist(), strict=True):
            for pool in (k_cache, v_cache):
                rows = pool[table].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
                expected ^= _xor_words(rows)
    assert paged_decode.read_paged_kv(caches, tables, seq_lens, threads) == expected
    with pytest.raises(ValueError, match="outside the pools"):
        paged_decode.read_paged_kv(caches, tables + blocks, seq_lens, threads)
