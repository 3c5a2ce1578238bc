"""The kernels' instruction-set variants ($MODELYARD_CPU_ISA): the flags each builds with, the
choice of variant (bad values and CPUs without the instructions warn and build auto), and every
variant this CPU can run against the torch references: the panel GEMM and the decode attention
kernel, whose SIMD tiles (AVX-512 or AVX2) and portable paths each build takes; and bf16 weights
falling back to fp32 on CPUs without native bf16."""

from __future__ import annotations

import logging
import platform

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.model import loader
from engine.model.attention.torch_reference import write_kv_cache_torch
from engine.model.cpu.kernels import build, paged_decode, panel_gemm
from tests.engine.test_attention import make_batch, reference_attention
from tests.engine.test_cpu_decode_kernel import ATOL, RAGGED, naive_decode
from tests.engine.test_cpu_panel_gemm import check_paired

torch.set_num_threads(2)

X86 = platform.machine().lower() in ("x86_64", "amd64")
CPU_FLAGS = build._cpu_flags()
# The variants this CPU runs, each with the instruction set its build reports.
VARIANTS = [
    isa
    for isa, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"}), ("generic", set()))
    if X86 and needs <= CPU_FLAGS
]
AVX2_FLAGS = {"avx", "avx2", "fma"}

needs_compiler = pytest.mark.skipif(
    not build.available(), reason="no C compiler: the kernel cannot be built here"
)


@pytest.fixture(params=VARIANTS)
def kernel_isa(request, monkeypatch) -> str:
    """$MODELYARD_CPU_ISA set to one variant: every kernel call of the test runs its build."""
    monkeypatch.setenv(build.ISA_ENV, request.param)
    build.reset()
    yield request.param
    build.reset()


def test_flags_per_variant_and_machine():
    native = build.compile_flags("native", "x86_64")
    assert "-march=native" in native and "-mprefer-vector-width=512" in native
    avx2 = build.compile_flags("avx2", "x86_64")
    assert "-march=haswell" in avx2 and "-march=native" not in avx2
    assert "-march=x86-64" in build.compile_flags("generic", "x86_64")
    for machine in ("aarch64", "ppc64le", "riscv64"):  # -march values are x86's: none elsewhere
        for variant in ("native", "avx2", "generic"):
            flags = build.compile_flags(variant, machine)
            assert "-O3" in flags and not [f for f in flags if f.startswith(("-march", "-mt"))]


@pytest.mark.parametrize(
    ("asked", "machine", "cpu", "variant", "warns"),
    [
        ("auto", "x86_64", AVX2_FLAGS, "native", False),
        ("avx512", "x86_64", AVX2_FLAGS | {"avx512f"}, "native", False),
        ("avx512", "x86_64", AVX2_FLAGS, "native", True),  # lacks avx512f
        ("avx2", "x86_64", AVX2_FLAGS | {"avx512f"}, "avx2", False),
        ("avx2", "x86_64", {"avx", "avx2"}, "native", True),  # lacks fma
        ("generic", "x86_64", AVX2_FLAGS, "generic", False),
        ("avx2", "aarch64", {"asimd"}, "native", True),
        ("generic", "aarch64", {"asimd"}, "native", False),  # plain C is all there is
        ("sse9", "x86_64", AVX2_FLAGS, "native", True),
    ],
)
def test_variant_choice(asked, machine, cpu, variant, warns, caplog):
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.resolve_isa(asked, machine, cpu) == variant
    messages = [r.getMessage() for r in caplog.records if r.name == build.__name__]
    assert len(messages) == (1 if warns else 0)
    assert all(build.ISA_ENV in m and "auto" in m for m in messages)


def test_unknown_isa_argument_raises():
    with pytest.raises(ValueError, match="sse9"):
        build.load("sse9")


@needs_compiler
@pytest.mark.skipif(not X86, reason="the ISA variants are x86's")
def test_env_var_picks_the_build(monkeypatch, caplog):
    """The default load follows $MODELYARD_CPU_ISA (read once, until reset); a bad value warns
    and builds auto; `build.load(isa)` loads another variant beside the default."""
    try:
        for asked in VARIANTS:
            monkeypatch.setenv(build.ISA_ENV, asked)
            build.reset()
            assert build.isa() == asked
            assert build.load() is build.load(asked)
        auto = build.load("auto").kernels_isa().decode()
        assert auto == VARIANTS[0]  # the best the CPU has
        monkeypatch.setenv(build.ISA_ENV, "sse9")
        build.reset()
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            assert build.isa() == auto
        assert any("sse9" in r.getMessage() for r in caplog.records)
    finally:
        build.reset()


@needs_compiler
def test_each_variant_reports_its_isa(kernel_isa):
    lib = build.load()
    assert build.isa() == kernel_isa == lib.kernels_isa().decode()
    assert lib.panel_gemm_available() == (kernel_isa != "generic")


@needs_compiler
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (7, 17), (100, 33), (130, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_panel_gemm_every_variant(kernel_isa, out_features, in_features, bias):
    """Rows 1..MAX_ROWS (every tile shape of the AVX2 kernel: 1, 2-3, 4-6 and remainders), output
    widths cut short of 8/32/64 columns, odd K; generic builds leave the GEMM to oneDNN."""
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    packed = panel_gemm.pack(weight)
    if kernel_isa == "generic":
        assert packed is None
        return
    for rows in (1, 2, 3, 4, 5, 6, 7, 11, panel_gemm.MAX_ROWS):
        x = torch.randn(rows, in_features, generator=generator)
        out = panel_gemm.linear(x, packed, out_features, b, 2)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("half", [3, 16, 40])
def test_paired_gated_panel_gemm_every_variant(kernel_isa, half):
    """A [gate; up] weight packed paired: both halves and silu(gate) * up, every row tile."""
    if kernel_isa == "generic":
        pytest.skip("no panel GEMM in generic builds")
    generator = torch.Generator().manual_seed(half)
    weight = torch.randn(2 * half, 33, generator=generator)
    b = torch.randn(2 * half, generator=generator)
    packed = panel_gemm.pack(weight, paired=True)
    for rows in (1, 2, 3, 4, 6, 9):
        check_paired(torch.randn(rows, 33, generator=generator), packed, weight, b)


@needs_compiler
@pytest.mark.parametrize("head_dim", [24, 32, 64, 128])  # 24: portable tiles everywhere
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_every_variant(kernel_isa, head_dim, kv_dtype):
    """Ragged sequences (partial tiles, several chunks), GQA, softcap and window, fp32 or bf16
    pools, against the float64 references of the same (bf16-rounded) values."""
    batch = make_batch([1] * len(RAGGED), RAGGED, q_heads=9, kv_heads=3, head_dim=head_dim,
                       block_size=16, dtype=kv_dtype, seed=head_dim)  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    scale = head_dim**-0.5
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens, scale)
    for window, softcap in ((None, None), (20, 5.0)):
        out = paged_decode.paged_decode_attention(batch.query.float(), *args, window, softcap, 2)
        expected = reference_attention(batch, scale, window, softcap)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)
    if kv_dtype == torch.float32:
        naive = naive_decode(batch, scale, None, None)
        out = paged_decode.paged_decode_attention(batch.query, *args, None, None, 1)
        torch.testing.assert_close(out.double(), naive, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_bf16_weights_need_native_bf16(monkeypatch, caplog, native, kv_cache_dtype):
    """--dtype bfloat16 on a CPU without native bf16 GEMMs: float32 weights and one warning naming
    the alternative; an auto KV cache stays bf16, an explicit one as given. Other dtypes, other
    devices and native-bf16 CPUs are left alone."""
    monkeypatch.setattr(loader, "native_bf16", lambda: native)
    config = EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        dtype = loader.cpu_weight_dtype(config, cpu, torch.bfloat16)
        assert loader.cpu_weight_dtype(config, cpu, torch.float32) == torch.float32
        assert loader.cpu_weight_dtype(config, torch.device("cuda"), torch.bfloat16) == (
            torch.bfloat16
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    if native:
        assert dtype == torch.bfloat16 and not warnings and config.kv_cache_dtype == kv_cache_dtype
        return
    assert dtype == torch.float32
    assert config.kv_cache_dtype == ("bfloat16" if kv_cache_dtype == "auto" else "float32")
    assert len(warnings) == 1 and "--dtype float32" in warnings[0] and "AVX512-BF16" in warnings[0]
