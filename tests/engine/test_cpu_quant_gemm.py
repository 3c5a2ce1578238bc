"""The narrow-weight GEMM (kernels/quant_gemm.c), every instruction-set build this CPU runs,
against a torch reference that rounds the activations as the kernel's contract says."""

from __future__ import annotations

import pytest
import torch

from engine.model.cpu import quant_formats
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.quant_formats import BLOCK, HALF, QuantizedWeight, as_format, quantize


def _runnable_builds() -> list[str]:
    """The kernel builds whose instructions this CPU has (a build asked for an instruction set the
    CPU lacks comes back as another one)."""
    names = []
    for isa in ("avx512", "avx2", "generic"):
        lib = quant_gemm.library(isa)
        if lib is not None and lib.kernels_isa().decode() == isa:
            names.append(isa)
    return names


BUILDS = _runnable_builds()
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C compiler here")


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations: per row and block of 32, d = max|x| / 127 and q = x / d
    rounded half to even, in fp32 as the C code computes them. (q [M, K], d [M, K / 32])"""
    blocks = x.view(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inverse[..., None]).view_as(x), d


def run(
    isa: str, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, threads: int = 2
) -> torch.Tensor:
    """The kernel of build ``isa`` on ``weight`` packed by that build."""
    lib = quant_gemm.library(isa)
    packed = quant_gemm.pack(lib, weight)
    return quant_gemm.gemm(lib, weight.fmt, x, packed, weight.out_features, bias, threads)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    q, d = quantized_activations(x)
    x_rounded = (q.view(x.shape[0], -1, BLOCK) * d[..., None]).view_as(x)
    y = x_rounded.double() @ weight.dequantize().double().T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("fmt", quant_formats.FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 64])  # every remainder of the 4-row groups
# widths: one column, groups of 8 cut short, several tiles
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (17, 64), (33, 96), (130, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_quant_gemm_matches_the_torch_reference(isa, fmt, rows, out_features, in_features, bias):
    """Ragged output widths (groups of 8 interleaved columns cut short), ragged row groups, bias
    or not."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = quantize(torch.randn(out_features, in_features, generator=generator), fmt)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    out = run(isa, weight, x, b)
    torch.testing.assert_close(out, reference(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("fmt", quant_formats.FORMATS)
def test_prefill_sized_inputs(isa, fmt):
    """Hundreds of rows (a prefill) on the same kernel; a slice of them gives the same rows."""
    generator = torch.Generator().manual_seed(301)
    weight = quantize(torch.randn(70, 576, generator=generator), fmt)
    b = torch.randn(70, generator=generator)
    x = torch.randn(301, 576, generator=generator)
    out = run(isa, weight, x, b)
    torch.testing.assert_close(out, reference(x, weight, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[-5:], run(isa, weight, x[-5:].contiguous(), b))


@pytest.mark.parametrize("isa", BUILDS)
def test_extreme_blocks(isa):
    """int8, int8h and int8k weights of -128 (GGUF's Q8_0 allows it; the AVX2 dot reads |w| as
    unsigned), of 127, and of each in one half only (int8k's halves' sums and corrections apart),
    int8h's largest and subnormal fp16 scales, int4 nibbles of 0 and 15 (int4k's too, with its 6-bit
    scales at 63), int5 integers of 0 and 31 (int5k's too, with its sc and mc at 0 and 63; int5h's
    with its largest and subnormal fp16 scales) and int6's of 0 and 63 (the AVX2 dot's 16-bit pair
    sums at their largest), each in one half only, the bits above the nibbles alone, all-zero
    activation blocks (scale 0) and all-zero weight blocks."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 50
    x[1, :32] = 0.0
    int8 = quantize(torch.randn(5, 64), "int8")
    raw = int8.records[:, 8:].view(torch.int8)
    raw[0], raw[1] = -128, 127
    int8.records[2] = 0  # scale 0, q 0
    int8h = quantize(torch.randn(5, 64), "int8h")  # d [2] f16, q [2][32]
    raw = int8h.records[:, 4:].view(torch.int8)
    raw[0], raw[1] = -128, 127
    scales = int8h.records[:, :4].view(torch.float16)
    scales[1] = torch.tensor([65504.0, -65504.0])  # the largest fp16s, times q's extremes
    scales[2] = torch.tensor([2.0**-24, -(2.0**-14) * 1023 / 1024])  # subnormals
    int8h.records[3] = 0
    int4 = quantize(torch.randn(5, 64), "int4")
    int4.records[0, 16:], int4.records[1, 16:] = 0x00, 0xFF
    int4k = quantize(torch.randn(5, 64), "int4k")  # D, M f32, sc [2], mc [2], nibbles [2][16]
    int4k.records[0, 12:], int4k.records[1, 8:12], int4k.records[1, 12:] = 0x00, 63, 0xFF
    int5 = quantize(torch.randn(5, 64), "int5")  # d, m [2] f32, nibbles [2][16], fifth bits [2][4]
    int5.records[0, 16:], int5.records[1, 16:] = 0x00, 0xFF
    int5.records[2, 16:48], int5.records[2, 48:] = 0x00, 0xFF
    # int5k: D, M f32, sc [2], mc [2], nibbles [2][16], fifth bits [2][4]
    int5k = quantize(torch.randn(5, 64), "int5k")
    int5k.records[0, 12:], int5k.records[1, 8:12], int5k.records[1, 12:] = 0x00, 63, 0xFF
    int5k.records[2, 8:12], int5k.records[2, 12:44], int5k.records[2, 44:] = 0, 0x00, 0xFF
    int5k.records[3, 8:10], int5k.records[3, 10:12] = 63, 0  # sc 63, mc 0
    int5k.records[4, 8:10], int5k.records[4, 10:12] = 0, 63  # sc 0, mc 63
    int5h = quantize(torch.randn(6, 64), "int5h")  # d [2] f16, nibbles [2][16], fifth bits [2][4]
    int5h.records[0, 4:], int5h.records[1, 4:] = 0x00, 0xFF  # q 0 (w = -16 d) and 31 (15 d)
    int5h.records[2, 4:36], int5h.records[2, 36:] = 0x00, 0xFF  # the fifth bits alone: q 16
    int5h.records[3, 4:20], int5h.records[3, 20:36] = 0xFF, 0x00  # halves apart: q 15 and 0
    int5h.records[4, 4:], int5h.records[4, :4] = 0xFF, 0  # scales 0
    int5h.records[5, 4:] = 0x00  # the largest fp16s times q 0, then subnormals
    int5h.records[1, :4] = int5h.records[5, :4] = (
        torch.tensor([65504.0, -65504.0]).half().view(torch.uint8)
    )
    int5h.records[3, :4] = (
        torch.tensor([2.0**-24, -(2.0**-14) * 1023 / 1024]).half().view(torch.uint8)
    )
    int6 = quantize(torch.randn(5, 64), "int6")  # d_lo, d_hi [2] f32, nibbles [2][16], pairs [2][8]
    int6.records[0, 16:], int6.records[1, 16:] = 0x00, 0xFF
    int6.records[2, 16:48], int6.records[2, 48:] = 0x00, 0xFF
    int6.records[3, 16:48], int6.records[3, 48:] = 0x0F, 0x00  # low halves 15, high halves 0
    int8k = quantize(torch.randn(6, 64), "int8k")
    q = int8k.records[:, 24:].view(torch.int8).view(6, 2, 2, BLOCK // 2)  # [column, block, half]
    q[0], q[1] = -128, 127
    q[2, :, 0], q[2, :, 1] = -128, 127
    q[3, :, 0], q[3, :, 1] = 127, -128
    int8k.records[4] = 0  # scales and offset 0, q 0
    for weight in (int8, int8h, int4, int4k, int5, int5h, int5k, int6, int8k):
        out = run(isa, weight, x, None, threads=1)
        torch.testing.assert_close(out, reference(x, weight, None), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("fmt", ["int4k", "int5k"])
def test_super_scaled_formats_across_super_blocks(isa, fmt):
    """int4k and int5k over 19 blocks: super-blocks of 8, 8 and a last one of 3, each its own D
    and M (signs and sizes apart), their extremes in the last one (q at its largest and 0, sc and
    mc 63 and 0), 11 columns (a group cut short): the GEMM against the float64 reference, the
    rows read back bit for bit as the records dequantise."""
    blocks, supers, n = 19, 3, 11
    generator = torch.Generator().manual_seed(19)
    weight = quantize(torch.randn(n, blocks * BLOCK, generator=generator), fmt)
    records = weight.records
    heads = records[:, : 8 * supers].clone().view(torch.float32)  # D [3], M [3] per column
    records[:, : 8 * supers] = (heads * torch.tensor([1.0, 40.0, 0.25, 0.5, 30.0, 3.0])).view(
        torch.uint8
    )
    sc, mc = (slice(8 * supers + i * blocks + 16, 8 * supers + (i + 1) * blocks) for i in (0, 1))
    values = slice(8 * supers + 2 * blocks + 16 * 16, 8 * supers + 2 * blocks + 16 * blocks)
    records[0, sc], records[0, mc], records[0, values] = 63, 63, 0xFF  # q 15: int4's largest
    records[1, sc], records[1, mc], records[1, values] = 0, 0, 0x00
    records[2, sc], records[2, mc] = 63, 0
    records[3, sc], records[3, mc] = 0, 63
    if fmt == "int5k":  # the fifth bits: q 31 in column 0, 0 in 1, only the fifth bit in 4
        upper = slice(8 * supers + 18 * blocks + 4 * 16, 8 * supers + 18 * blocks + 4 * blocks)
        records[0, upper], records[1, upper] = 0xFF, 0x00
        records[4, values], records[4, upper] = 0x00, 0xFF
    big_d, big_m = records[0, : 8 * supers].clone().view(torch.float32).view(2, supers)[:, -1]
    top = (big_d * 63) * (31 if fmt == "int5k" else 15) + big_m * 63
    assert torch.equal(weight.dequantize()[0, 16 * BLOCK :], top.expand(3 * BLOCK))
    x = torch.randn(5, blocks * BLOCK, generator=generator) * 10
    out = run(isa, weight, x, None)
    torch.testing.assert_close(out, reference(x, weight, None), rtol=1e-5, atol=1e-3)
    lib = quant_gemm.library(isa)
    ids = torch.arange(n).flip(0)
    rows = quant_gemm.unpack_rows(lib, fmt, quant_gemm.pack(lib, weight), n, blocks * BLOCK, ids)
    assert torch.equal(rows, weight.dequantize(ids))


@pytest.mark.parametrize("isa", BUILDS)
def test_int2k_extremes_across_super_blocks(isa):
    """int2k over 19 blocks (super-blocks of 8, 8 and 3, each its own D and M), its extremes in the
    last one: q 3 under sc and mc 15 (column 0), q 0 under 0 (1), sc 15 and mc 0 (2), sc 0 and mc
    15 (3), one half's q 3 and the other's 0 (4); 11 columns: the GEMM against the float64
    reference and bit for bit its int8km widening's, the rows read back as the records
    dequantise."""
    blocks, supers, n = 19, 3, 11
    generator = torch.Generator().manual_seed(2)
    weight = quantize(torch.randn(n, blocks * BLOCK, generator=generator), "int2k")
    records = weight.records  # D [3], M [3] f32, first halves' bytes [19], second's [19], q [19][8]
    heads = records[:, : 8 * supers].clone().view(torch.float32)
    records[:, : 8 * supers] = (heads * torch.tensor([1.0, 40.0, 0.25, 0.5, 30.0, 3.0])).view(
        torch.uint8
    )
    last = [slice(8 * supers + h * blocks + 16, 8 * supers + (h + 1) * blocks) for h in (0, 1)]
    q = records[:, 8 * supers + 2 * blocks :].view(n, blocks, 8)[:, 16:]
    for column, (first, second, values) in enumerate(
        [(0xFF, 0xFF, 0xFF), (0x00, 0x00, 0x00), (0x0F, 0x0F, None), (0xF0, 0xF0, None)]
    ):
        records[column, last[0]], records[column, last[1]] = first, second
        if values is not None:
            q[column] = values
    q[4, :, :4], q[4, :, 4:] = 0xFF, 0x00
    big_d, big_m = records[0, : 8 * supers].clone().view(torch.float32).view(2, supers)[:, -1]
    top = (big_d * 15) * 3 + big_m * 15
    assert torch.equal(weight.dequantize()[0, 16 * BLOCK :], top.expand(3 * BLOCK))
    x = torch.randn(5, blocks * BLOCK, generator=generator) * 10
    out = run(isa, weight, x, None)
    torch.testing.assert_close(out, reference(x, weight, None), rtol=1e-5, atol=1e-3)
    assert torch.equal(out, run(isa, as_format(weight, "int8km"), x, None))
    lib = quant_gemm.library(isa)
    ids = torch.arange(n).flip(0)
    rows = quant_gemm.unpack_rows(
        lib, "int2k", quant_gemm.pack(lib, weight), n, blocks * BLOCK, ids
    )
    assert torch.equal(rows, weight.dequantize(ids))


@pytest.mark.parametrize("isa", BUILDS)
def test_int8h_reads_every_fp16_scale_exactly(isa):
    """int8h's fp16 scales widened in the kernel (vcvtph2ps, or the generic build's plain C) and in
    its row read-back: every one of the 65,536 bit patterns (subnormals, the largest, the
    infinities and NaNs) as one column's scale, q = 1, against activations that quantise exactly
    (d_x = 1): each output is 127 d in fp32, exact, and each row read back is d."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    n = patterns.numel()
    records = torch.ones(n, 2 + BLOCK, dtype=torch.uint8)  # q = 1
    records[:, :2] = patterns.view(torch.uint8).view(n, 2)
    weight = QuantizedWeight("int8h", BLOCK, records)
    x = torch.zeros(1, BLOCK)
    x[0, 0] = 127.0
    d = patterns.float()
    out = run(isa, weight, x, None)[0]
    torch.testing.assert_close(out, 127 * d, rtol=0, atol=0, equal_nan=True)
    lib = quant_gemm.library(isa)
    ids = torch.arange(n)
    rows = quant_gemm.unpack_rows(lib, "int8h", quant_gemm.pack(lib, weight), n, BLOCK, ids)
    torch.testing.assert_close(rows, d[:, None].expand(n, BLOCK), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(rows.isnan(), weight.dequantize().isnan())


@pytest.mark.parametrize("isa", BUILDS)
def test_int5h_reads_every_finite_fp16_scale_exactly(isa):
    """int5h's fp16 scales widened in the kernel (vcvtph2ps, or the generic build's plain C) and in
    its row read-back, with the offset -16 d: every finite fp16 bit pattern (subnormals and the
    largest included; an infinite d has no finite -16 d to read back by) as one column's scale,
    q = 17 in the first element and 16 (w = 0) in the rest, against activations that quantise
    exactly (d_x = 1): each output is 127 d in fp32, exact, and each row read back d, 0, ..."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    patterns = patterns[patterns.isfinite()]
    n = patterns.numel()
    records = torch.zeros(n, 2 + HALF + 4, dtype=torch.uint8)  # nibbles 0, fifth bits all set
    records[:, :2] = patterns.view(torch.uint8).view(n, 2)
    records[:, 2], records[:, 2 + HALF :] = 0x01, 0xFF  # element 0's nibble 1: q 17
    weight = QuantizedWeight("int5h", BLOCK, records)
    x = torch.zeros(1, BLOCK)
    x[0, 0] = 127.0
    d = patterns.float()
    out = run(isa, weight, x, None)[0]
    torch.testing.assert_close(out, 127 * d, rtol=0, atol=0)
    lib = quant_gemm.library(isa)
    ids = torch.arange(n)
    rows = quant_gemm.unpack_rows(lib, "int5h", quant_gemm.pack(lib, weight), n, BLOCK, ids)
    expected = torch.zeros(n, BLOCK)
    expected[:, 0] = d
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    assert torch.equal(rows, weight.dequantize())


@pytest.mark.parametrize("isa", BUILDS)
def test_int5h_multiplies_as_int5(isa):
    """int5h's GEMM is int5's on the same values (its m = -16 d, exact), bit for bit: ragged rows
    and a group of 8 columns cut short."""
    generator = torch.Generator().manual_seed(5)
    weight = quantize(torch.randn(35, 608, generator=generator), "int5h")
    x = torch.randn(9, 608, generator=generator)
    assert torch.equal(run(isa, weight, x, None), run(isa, as_format(weight, "int5"), x, None))


@pytest.mark.parametrize("fmt", quant_formats.FORMATS)
def test_every_build_gives_the_same_numbers(fmt):
    """The integer dots are exact in every build: only the fp32 sums of blocks differ in order."""
    generator = torch.Generator().manual_seed(7)
    weight = quantize(torch.randn(96, 1536, generator=generator), fmt)
    x = torch.randn(6, 1536, generator=generator)
    outs = [run(isa, weight, x, None) for isa in BUILDS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-4)


def test_quantize_round_trips_within_half_a_step():
    """Quantisation error per weight is at most half a step: d / 2 for every format (int8k's d
    per half of a block, its offset centring the block; int8km's centring each half)."""
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    blocks = weight.view(8, -1, BLOCK)
    halves = (blocks - (blocks.amax(-1, True) + blocks.amin(-1, True)) / 2).view(8, -1, 2, 16)
    sides = blocks.view(8, -1, 2, 16)
    spans = (sides.amax(-1, True) - sides.amin(-1, True)) / 2
    for fmt, step in (
        ("int8", blocks.abs().amax(-1, True) / 127),
        ("int4", (blocks.amax(-1, True) - blocks.amin(-1, True)) / 15),
        ("int5", (blocks.amax(-1, True) - blocks.amin(-1, True)) / 31),
        ("int6", (sides.abs().amax(-1, True) / 31).expand(-1, -1, -1, 16).reshape_as(blocks)),
        ("int8k", (halves.abs().amax(-1, True) / 127).expand(-1, -1, -1, 16).reshape_as(blocks)),
        ("int8km", (spans / 127).expand(-1, -1, -1, 16).reshape_as(blocks)),
    ):
        error = (quantize(weight, fmt).dequantize() - weight).abs().view(8, -1, BLOCK)
        assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all(), fmt


@pytest.mark.parametrize(
    ("fmt", "levels", "span"), [("int4k", 15, 32), ("int5k", 31, 32), ("int2k", 3, 16)]
)
def test_super_scaled_quantisers_keep_the_offsets(fmt, levels, span):
    """int4k and int5k quantise each block (int2k each half-block) against its minimum (M <= 0
    times a 6-bit, int2k's 4-bit, mc): every weight within a step of its span's range, the
    rounding of sc and mc taking part of that (the offsets once came out 0, clamping every
    negative weight to 0)."""
    weight = torch.randn(8, 512, generator=torch.Generator().manual_seed(3))
    spans = weight.view(8, -1, span)
    step = (spans.amax(-1, True) - spans.amin(-1, True).clamp(max=0)) / levels
    error = (quantize(weight, fmt).dequantize() - weight).abs().view(8, -1, span)
    assert (error <= step).all()


def test_formats_reject_what_they_cannot_hold():
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.zeros(4, 48), "int8")
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.zeros(4, 64), "int3")


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("fmt", quant_formats.FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (17, 64), (130, 576)])
def test_rows_read_back_from_the_packed_layout_are_the_records_values(
    isa, fmt, out_features, in_features
):
    """An embedding tied to a narrow lm_head looks its rows up in the head's packed weight: every
    row, in any order and repeated, equals the records' dequantised row bit for bit; an id out of
    range is an IndexError, not a read past the weight."""
    generator = torch.Generator().manual_seed(out_features)
    weight = quantize(torch.randn(out_features, in_features, generator=generator) * 3, fmt)
    lib = quant_gemm.library(isa)
    packed = quant_gemm.pack(lib, weight)
    ids = torch.randint(0, out_features, (40,), generator=generator)
    ids[:2] = torch.tensor([out_features - 1, 0])
    rows = quant_gemm.unpack_rows(lib, fmt, packed, out_features, in_features, ids)
    assert torch.equal(rows, weight.dequantize(ids))
    for bad in (out_features, -1):
        with pytest.raises(IndexError):
            quant_gemm.unpack_rows(lib, fmt, packed, out_features, in_features, torch.tensor([bad]))
