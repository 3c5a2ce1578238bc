"""Triton paged-attention kernels against the torch path, on CPU under TRITON_INTERPRET=1.

`triton.jit` reads TRITON_INTERPRET when the kernels are defined, and another test module of the
same pytest process may already have imported Triton or engine.model.attention.triton_kernels
without it. So the one test here re-runs this file in a fresh `python -m pytest` with the variable
set, collecting the `check_*` functions below (which the normal run does not collect) as the kernel
cases.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.attention.backends import BACKEND_ENV, paged_attention, select_backend
from tests.engine.test_attention import PagedBatch, head_major, make_batch, reference_attention

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(BACKEND_ENV, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "python_functions=check_*", __file__]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def run(
    batch: PagedBatch, backend: str, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on private copies of the cache; returns (output, k_cache, v_cache)."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    out = paged_attention(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta,
        backend=backend, **kwargs,
    )  # fmt: skip
    return out, k_cache, v_cache


def assert_kernels_match(batch: PagedBatch, **kwargs) -> None:
    out, k_cache, v_cache = run(batch, "triton", **kwargs)
    expected, k_expected, v_expected = run(batch, "torch", **kwargs)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    # The cache write is a pure copy: bit-identical, and no other slot touched.
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    if batch.query.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
        ref = reference_attention(batch, kwargs["scale"], kwargs.get("sliding_window"),
                                  kwargs.get("softcap"))  # fmt: skip
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


DECODE = ([1] * 6, [1, 5, 16, 17, 40, 9])
MIXED = ([1, 1, 20, 6, 3, 1 + 1], [33, 4, 20, 27, 3, 40])  # decodes, prefill, chunks over a prefix
HEADS = {"gqa": (6, 2, 24), "mha": (4, 4, 32), "mqa": (4, 1, 24)}  # (Hq, Hkv, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ["decode", "mixed"])
@pytest.mark.parametrize("heads", HEADS)
def check_kernels_match_torch(dtype: torch.dtype, shape: str, heads: str):
    query_lens, seq_lens = DECODE if shape == "decode" else MIXED
    q_heads, kv_heads, head_dim = HEADS[heads]
    batch = make_batch(
        query_lens, seq_lens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, seed=head_dim,
    )  # fmt: skip
    assert_kernels_match(batch, scale=head_dim**-0.5)


@pytest.mark.parametrize("shape", ["decode", "mixed"])
@pytest.mark.parametrize(
    ("sliding_window", "softcap", "dtype"),
    [(5, None, torch.float32), (None, 2.0, torch.float32), (13, 3.0, torch.float32),
     (13, 3.0, torch.float16)],
)  # fmt: skip
def check_sliding_window_and_softcap(
    dtype: torch.dtype, shape: str, sliding_window: int | None, softcap: float | None
):
    query_lens, seq_lens = DECODE if shape == "decode" else MIXED
    batch = make_batch(query_lens, seq_lens, q_heads=6, kv_heads=2, head_dim=24, dtype=dtype)
    assert_kernels_match(batch, scale=0.6, sliding_window=sliding_window, softcap=softcap)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def check_block_sizes_smaller_and_larger_than_a_tile(block_size: int):
    batch = make_batch(*MIXED, block_size=block_size, head_dim=16, seed=block_size)
    assert_kernels_match(batch, scale=0.3)


def check_long_prefill_spans_several_query_and_key_tiles():
    batch = make_batch([50, 37], [70, 37], q_heads=4, kv_heads=2, head_dim=16, block_size=16)
    assert_kernels_match(batch, scale=0.25, sliding_window=20)


def check_bfloat16():
    batch = make_batch(*MIXED, q_heads=6, kv_heads=3, head_dim=24, dtype=torch.bfloat16)
    assert_kernels_match(batch, scale=0.2)


@pytest.mark.parametrize("shape", ["decode", "mixed"])
def check_head_major_inputs(shape: str):
    batch = make_batch(*(DECODE if shape == "decode" else MIXED), q_heads=6, kv_heads=2)
    expected, k_expected, v_expected = run(batch, "torch", scale=0.4)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    out = paged_attention(
        head_major(batch.query), head_major(batch.key), head_major(batch.value),
        k_cache, v_cache, batch.meta, scale=0.4, backend="triton",
    )  # fmt: skip
    assert out.is_contiguous()
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (9, 2.0)])
def check_split_decode(num_splits: int, sliding_window: int | None, softcap: float | None):
    """Split-K decode (several programs per sequence, then a merge) equals the torch path; some
    splits cover nothing of a short sequence or lie outside its window."""
    from engine.model.attention import triton_kernels as kernels

    batch = make_batch(*DECODE, q_heads=6, kv_heads=2, head_dim=24)
    kwargs = {"scale": 0.5, "sliding_window": sliding_window, "softcap": softcap}
    expected, k_cache, v_cache = run(batch, "torch", **kwargs)
    out = kernels.decode_attention(
        batch.query, k_cache, v_cache, batch.meta, 0.5, sliding_window, softcap,
        num_splits=num_splits,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def check_prefill_kernel_also_handles_a_decode_batch():
    from engine.model.attention import triton_kernels as kernels

    batch = make_batch(*DECODE, q_heads=6, kv_heads=2, head_dim=24)
    expected, k_cache, v_cache = run(batch, "torch", scale=0.4, sliding_window=6)
    out = kernels.prefill_attention(batch.query, k_cache, v_cache, batch.meta, 0.4, 6, None)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def check_dispatch_by_batch_kind_and_environment(monkeypatch: pytest.MonkeyPatch):
    from engine.model.attention import triton_kernels as kernels

    calls: list[str] = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    monkeypatch.setenv(BACKEND_ENV, "triton")
    for query_lens, seq_lens in (DECODE, MIXED):
        batch = make_batch(query_lens, seq_lens)
        paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                        batch.meta, scale=0.5,
                        backend=select_backend(batch.query.device))  # fmt: skip
    assert calls == ["decode_attention", "prefill_attention"]
    monkeypatch.setenv(BACKEND_ENV, "torch")
    batch = make_batch(*DECODE)
    paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
                    scale=0.5, backend=select_backend(batch.query.device))  # fmt: skip
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
def test_kernels_compile_for_hopper():
    """Build every kernel for sm_90 with Triton's bundled ptxas (no GPU needed): catches what the
    interpreter accepts but the compiler rejects (dot shapes, dtypes, control flow)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    # The modules themselves: the package re-exports functions of the same names.
    package = "engine.model.attention.triton_kernels"
    common = importlib.import_module(f"{package}.common")
    cache_write = importlib.import_module(f"{package}.cache_write")
    decode_attention = importlib.import_module(f"{package}.decode_attention")
    prefill_attention = importlib.import_module(f"{package}.prefill_attention")
    if common.INTERPRETED:
        pytest.skip("kernels were defined under TRITON_INTERPRET=1 in this process")
    tensors = ("key", "value", "q", "k_cache", "v_cache", "out")
    fp32_tensors = ("part_max", "part_sum", "part_acc")
    int_tensors = ("slot", "block_tables", "seq_lens", "query_start")
    cases = [
        (cache_write._cache_write_kernel, dict(KV_HEADS=3, HEAD_DIM=24, H_PAD=4, D_PAD=32), 1),
        (
            decode_attention._decode_kernel,
            dict(HEAD_DIM=24, D_PAD=32, Q_PER_KV=3, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=32,
                 USE_WINDOW=True, USE_SOFTCAP=True, DOT_PRECISION="tf32", SPLIT=True),
            4,
        ),
        (
            decode_attention._merge_splits_kernel,
            dict(HEAD_DIM=24, D_PAD=32, SPLITS_PAD=8),
            1,
        ),
        (
            prefill_attention._prefill_kernel,
            dict(HEAD_DIM=24, D_PAD=32, Q_PER_KV=3, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=32,
                 USE_WINDOW=True, USE_SOFTCAP=True, DOT_PRECISION="tf32"),
            4,
        ),
    ]  # fmt: skip
    for kernel, constexprs, num_warps in cases:
        signature = {}
        for name in kernel.arg_names:
            base = name.removesuffix("_ptr")
            if name in constexprs:
                signature[name] = "constexpr"
            elif base in tensors:
                signature[name] = "*fp16"
            elif base in fp32_tensors:
                signature[name] = "*fp32"
            elif base in int_tensors:
                signature[name] = "*i64" if base == "slot" else "*i32"
            else:
                signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
        compiled = compile(
            ASTSource(kernel, signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        assert compiled.asm["cubin"], kernel.__name__
