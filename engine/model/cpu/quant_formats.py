"""Narrow weight formats of the CPU linears: quantising fp32 weights into them, reading GGUF's own
blocks into them, and the torch reference that turns them back into fp32.

Every format works in blocks of 32 consecutive inputs of one output column, GGUF's block size:

- ``int8``: ``w = d * q``, q in [-128, 127], one fp32 scale per block (symmetric, d = max|w| / 127),
  36 bytes a block: what we quantise at load, and GGUF's IQ4_XS (whose d is not an fp16).
- ``int8h``: int8 with the scale an fp16, 34 bytes a block: GGUF's Q8_0 (and IQ4_NL), whose blocks
  load as they are; quantising into it rounds d to fp16 (Q8_0's quantiser).
- ``int4``: ``w = d * q + m``, q in [0, 15], an fp32 scale and offset per block (d = (max - min) /
  15, m = min: GGUF's Q4_1; Q4_0's ``d * (q - 8)`` is the same with m = -8 d, so both load exactly).
- ``int4k``: int4 whose d and m are products: ``d = D * sc``, ``m = M * mc`` with sc, mc in
  [0, 63] per block and D, M fp32 per super-block of 8 blocks (the last may be shorter): GGUF's
  Q4_K (M = -dmin), 19 bytes a block of 32 where int4 takes 24.
- ``int5``: ``w = d * q + m``, q in [0, 31], as int4 with a fifth bit: GGUF's Q5_1, 28 bytes a
  block where int8 took 36.
- ``int5h``: int5 with the scale an fp16 and the offset -16 d implied (``w = d * (q - 16)``), 22
  bytes a block: GGUF's Q5_0, whose blocks load as they are (the file's size); quantising into it
  is Q5_0's quantiser (d the block's value of largest magnitude over -16, rounded to fp16). Its
  integers less 16 are int8s under the same fp16s: int8h holds it too, so a Q5_0 q/k beside a
  Q8_0 v fuse in int8h.
- ``int5k``: int5 as int4k is to int4 (``d = D * sc``, ``m = M * mc``, 6-bit sc and mc per block
  under fp32 D and M per 8 blocks): GGUF's Q5_K (M = -dmin), 23 bytes a block of 32 where int5
  takes 28 (the file 22).
- ``int2k``: ``w = d_half * q + m_half``, q in [0, 3], ``d_half = D * sc``, ``m_half = M * mc``
  with sc, mc in [0, 15] per half-block (one byte each, ``sc | mc << 4``) under fp32 D and M per
  super-block of 8 blocks: GGUF's Q2_K (M = -dmin), 11 bytes a block of 32 (the file 10.5).
- ``int6``: ``w = d_half * (q - 32)``, q in [0, 63], two fp32 scales per block (d_lo for elements
  0-15, d_hi for 16-31): GGUF's Q6_K, 32 bytes a block where int8k took 44.
- ``int8k``: ``w = d_half * q + m``, q in [-128, 127], two fp32 scales per block (d_lo for elements
  0-15, d_hi for 16-31) and one fp32 offset: Q3_K's scale per 16. Quantising
  into it centres each block (m = (max + min) / 2) and scales each half symmetrically; every other
  format converts into it exactly (`as_format`: int4k by way of int4, int5k and int5h of int5,
  int8h of int8, their scales spelled out in fp32), so projections of mixed formats still fuse
  (`concatenate`: in the narrowest format that holds every part, int8k where no other does).
- ``int8km``: int8k with an fp32 offset per half-block (m_lo, m_hi), 48 bytes a block: the fusion
  format of int2k, whose mins per 16 inputs int8k's one offset per block cannot hold. Every format
  converts into it exactly (int8k's offset each half's), so a Q2_K file's Q2_K q/k beside its
  Q3_K or Q4_K v fuse; it is taken only where a part is int2k (int2k beside int2k fuses as it
  is), so files without Q2_K keep their formats byte for byte. The other exact answers cost more:
  fused parts each in its own format would change the decode kernel's fused GEMMs, and a
  narrower common format (4-bit integers with a scale and offset per half) would hold Q3_K only
  by its integers' range, not by its format.

A weight [N, K] is held as N column records of `record_bytes` bytes each ([N, bytes] uint8): per
block of the column, int8: the scales, then the int8s; int8h: the same with 2-byte scales (the
file's fp16s, copied as they are); int4: the scales, the offsets, then the nibbles (16 bytes a
block, the low nibbles elements 0-15 and the high nibbles 16-31, GGUF's order); int4k: the
super-blocks' D, then their M, the blocks' sc, then their mc (a byte each), then int4's nibbles;
int5: int4's, then the fifth bits (4 bytes a block, a little-endian uint32 whose bit i is element
i's, GGUF's order); int5h: the 2-byte scales (the file's fp16s), then int5's nibbles and fifth bits;
int5k: int4k's, then int5's fifth bits; int6: the low-half scales, the high-half scales, int4's
nibbles, then the high bit pairs (8 bytes a block, bits 2 (i % 4) and up of byte i / 4 element i's);
int2k: the super-blocks' D, then their M, the blocks' first halves' bytes sc | mc << 4, then their
second halves', then the 2-bit integers (int6's high bit pairs' layout); int8k: the low-half
scales, the high-half scales, the offsets, then the int8s; int8km: int8k's with the low-half
offsets, then the high-half offsets. Records of one format
and K concatenate, so fused projections are a torch.cat; rows permute with an index
(kernels/quant_gemm.c reads them).

GGUF block types each format holds exactly (`GGUF_BLOCKS`): Q8_0 in int8h at its size in the file,
and there too IQ4_NL (``d * table[q]``, 4-bit indices into 16 fixed int8 values) at twice its size;
IQ4_XS (the same with d a super-block's fp16 times a 6-bit scale per 32, less 32: not an fp16) in
int8; Q4_1 and Q4_0 in int4; Q4_K, whose super-blocks of 256 carry 6-bit scales and offsets per 32
(``d * sc * q - dmin * m``), in int4k; Q2_K (the same with 4-bit scales and mins per 16 and
2-bit q) in int2k; Q5_0 (``d * (q - 16)``) in int5h at its size in the file;
Q5_1 (``d * q + m``) in int5; in int5k Q5_K (Q4_K's scales with 5-bit q); in int6 Q6_K (``d * sc *
(q - 32)``, sc int8 per 16, q 6 bits); in int8k Q3_K (``d * (sc - 32) * q``, sc 6 bits per 16, q in
[-4, 3]). The products d * sc and dmin * m are exact in fp32, being fp16 times integers of at most 8
bits (11 + 8 significant bits < 24), so each weight is gguf's own single rounding of that product
times q (plus the offset); int2k, int4k and int5k keep the fp16s (in fp32) and the integers apart,
and the kernels take the same exact products (int2k's in the steps int8km's take: its outputs are
its widened weight's bit for bit). GGUF stores its scales in fp16; widening them to fp32 is exact
(int8h and int5h keep them in fp16, the kernels widen them as they read them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
HALF = BLOCK // 2
FORMATS = (
    "int8",
    "int8h",
    "int2k",
    "int4",
    "int4k",
    "int5",
    "int5h",
    "int5k",
    "int6",
    "int8k",
    "int8km",
)
# GGUF block types that load into a format as they are: (format, elements and bytes per block).
GGUF_BLOCKS = {
    "Q8_0": ("int8h", 32, 34),
    "IQ4_NL": ("int8h", 32, 18),
    "IQ4_XS": ("int8", 256, 136),
    "Q5_0": ("int5h", 32, 22),
    "Q4_1": ("int4", 32, 20),
    "Q4_0": ("int4", 32, 18),
    "Q4_K": ("int4k", 256, 144),
    "Q5_1": ("int5", 32, 24),
    "Q5_K": ("int5k", 256, 176),
    "Q2_K": ("int2k", 256, 84),
    "Q3_K": ("int8k", 256, 110),
    "Q6_K": ("int6", 256, 210),
}
# Bytes per block of a record: its scales and offsets (fp32, int8h's and int5h's fp16; int2k's,
# int4k's and int5k's integers, their D and M apart: `record_bytes`), then its integers.
_BLOCK_BYTES = {
    "int8": 4 + BLOCK,
    "int8h": 2 + BLOCK,
    "int2k": 2 + BLOCK // 4,
    "int4": 8 + HALF,
    "int4k": 2 + HALF,
    "int5": 12 + HALF,
    "int5h": 6 + HALF,
    "int5k": 6 + HALF,
    "int6": 16 + HALF,
    "int8k": 12 + BLOCK,
    "int8km": 16 + BLOCK,
}
# fp32 scales and offsets per block of a record (int2k's, int4k's, int5k's, int5h's and int8h's:
# those of int8km, int4, int5 and int8, `_WIDENED`).
_FLOATS = {"int8": 1, "int4": 2, "int5": 2, "int6": 2, "int8k": 3, "int8km": 4}
# Bits above the nibbles per element of int5 and int6.
_UPPER_BITS = {"int5": 1, "int6": 2}


SUPER = 8  # blocks per super-block of int2k, int4k and int5k
# The formats of integer scales and offsets under fp32 D and M per super-block: their integers'
# largest, their scales' and offsets' largest, and the inputs each scale covers (int4k, int5k: 6
# bits per block; int2k: 4 bits per half-block, both in one byte, low nibble the scale).
_SUPER_SCALED = {"int4k": (15, 63, BLOCK), "int5k": (31, 63, BLOCK), "int2k": (3, 15, HALF)}
# int4k's and int5k's format of fp32 scales and offsets per block, of the same integers.
_SUPER_WIDER = {"int4k": "int4", "int5k": "int5"}


def record_bytes(fmt: str, k: int) -> int:
    """Bytes of one output column's record for ``k`` inputs (a multiple of BLOCK)."""
    blocks = k // BLOCK
    heads = 8 * _supers(blocks) if fmt in _SUPER_SCALED else 0  # D and M per super-block
    return heads + blocks * _BLOCK_BYTES[fmt]


def _supers(blocks: int) -> int:
    return (blocks + SUPER - 1) // SUPER


@dataclass
class QuantizedWeight:
    """A weight [out_features, in_features] in ``fmt``: ``records`` [out_features, bytes]."""

    fmt: str
    in_features: int
    records: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.records.shape[0]

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the output columns ``index`` (a permutation or a selection)."""
        return QuantizedWeight(self.fmt, self.in_features, self.records.index_select(0, index))

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K] (or [len(index), K]): the values the kernels multiply by."""
        records = self.records if index is None else self.records.index_select(0, index)
        n, blocks = records.shape[0], self.in_features // BLOCK
        if self.fmt in _WIDENED:  # by way of its first wider format: the same integers
            return _WIDENED[self.fmt][0][1](records, n, blocks).dequantize()
        floats = _FLOATS[self.fmt]
        head = records[:, : 4 * floats * blocks].contiguous().view(torch.float32)
        scales = head.view(n, floats, blocks, 1)
        if self.fmt in ("int4", "int5"):
            q = _unsigned_values(self.fmt, records[:, 8 * blocks :], n, blocks).float()
            return (scales[:, 0] * q + scales[:, 1]).view(n, self.in_features)
        if self.fmt == "int6":
            q = (_unsigned_values(self.fmt, records[:, 8 * blocks :], n, blocks).float() - 32).view(
                n, blocks, 2, HALF
            )
            return (scales.permute(0, 2, 1, 3) * q).reshape(n, self.in_features)
        q = records[:, 4 * floats * blocks :].contiguous().view(torch.int8).view(n, blocks, BLOCK)
        if self.fmt == "int8":
            return (scales[:, 0] * q.float()).view(n, self.in_features)
        halves = scales[:, :2].permute(0, 2, 1, 3)  # [n, blocks, 2 halves, 1]
        offsets = scales[:, 2:].permute(0, 2, 1, 3)  # [n, blocks, 1 (int8k) or 2 halves, 1]
        values = halves * q.view(n, blocks, 2, HALF).float() + offsets
        return values.reshape(n, self.in_features)


def _unsigned_values(fmt: str, ints: torch.Tensor, n: int, blocks: int) -> torch.Tensor:
    """int4, int5 or int6 integers, uint8 [n, blocks, 32], from their records' bytes past the
    scales (``ints``: the nibbles, then the bits above them)."""
    packed = ints[:, : HALF * blocks].reshape(n, blocks, HALF)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    if fmt == "int4":
        return q
    width = _UPPER_BITS[fmt]
    upper = ints[:, HALF * blocks :].reshape(n, blocks, 4 * width)
    return q | (_upper_values(upper, width) << 4).to(torch.uint8)


def _super_heads(records: torch.Tensor, n: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int2k, int4k or int5k records' D and M per block ([n, 2, blocks] fp32: each super-block's
    repeated) and their two bytes per block ([n, 2, blocks] int32: sc, mc; int2k's halves')."""
    supers = _supers(blocks)
    heads = records[:, : 8 * supers].reshape(-1).view(torch.float32).view(n, 2, supers)
    ints = records[:, 8 * supers : 8 * supers + 2 * blocks].reshape(n, 2, blocks).to(torch.int32)
    return heads.repeat_interleave(SUPER, dim=-1)[..., :blocks], ints


def _super_scaled_widener(wider: str):
    """The reader of int4k (int5k) records into int4 (int5) records: d = D * sc and m = M * mc
    spelled out, exact (an fp32 of GGUF's fp16 times an integer below 64); the nibbles (and fifth
    bits) as they are."""

    def widen(records: torch.Tensor, n: int, blocks: int) -> QuantizedWeight:
        heads, ints = _super_heads(records, n, blocks)
        scales = heads * ints.float()
        values = records[:, 8 * _supers(blocks) + 2 * blocks :]
        return QuantizedWeight(
            wider, blocks * BLOCK, _records(n, [scales[:, 0], scales[:, 1], values])
        )

    return widen


def _int2k_as_int8km(records: torch.Tensor, n: int, blocks: int) -> QuantizedWeight:
    """int2k records in int8km records: each half's d = D * sc and m = M * mc spelled out, exact
    (an fp32 of GGUF's fp16 times an integer below 16), the 2-bit integers as int8s."""
    heads, ints = _super_heads(records, n, blocks)  # ints: [n, 2 halves, blocks]
    d, m = heads[:, :1] * (ints & 0x0F).float(), heads[:, 1:] * (ints >> 4).float()
    pairs = records[:, 8 * _supers(blocks) + 2 * blocks :].reshape(n, blocks, BLOCK // 4)
    q = _upper_values(pairs, 2).to(torch.int8)
    return QuantizedWeight(
        "int8km", blocks * BLOCK, _records(n, [d[:, 0], d[:, 1], m[:, 0], m[:, 1], q])
    )


def _int8k_as_int8km(records: torch.Tensor, n: int, blocks: int) -> QuantizedWeight:
    """int8k records in int8km records: the block's offset each half's."""
    offset = records[:, 8 * blocks : 12 * blocks]
    parts = [records[:, : 8 * blocks], offset, offset, records[:, 12 * blocks :]]
    return QuantizedWeight("int8km", blocks * BLOCK, _records(n, parts))


def _fp16_scaled_widener(wider: str, offset: float | None):
    """The reader of int8h (int5h) records into int8 (int5) records: the fp16 scales widened to
    fp32 and int5h's offset spelled out (``offset`` times d: -16 d; None for int8, which has
    none), both exact (an fp16 times a power of two); the integers as they are."""

    def widen(records: torch.Tensor, n: int, blocks: int) -> QuantizedWeight:
        scales = records[:, : 2 * blocks].reshape(-1).view(torch.float16).float().view(n, blocks)
        offsets = [] if offset is None else [offset * scales]
        parts = [scales, *offsets, records[:, 2 * blocks :]]
        return QuantizedWeight(wider, blocks * BLOCK, _records(n, parts))

    return widen


def _int5h_as_int8h(records: torch.Tensor, n: int, blocks: int) -> QuantizedWeight:
    """int5h records' values in int8h records: the fp16 scales as they are, the integers less 16
    as int8s (d * (q - 16) either way)."""
    q = _unsigned_values("int5", records[:, 2 * blocks :], n, blocks).to(torch.int8) - 16
    return QuantizedWeight("int8h", blocks * BLOCK, _records(n, [records[:, : 2 * blocks], q]))


# The formats whose values wider ones hold exactly (besides int8k, which holds every format's but
# int2k's): those formats, each with the reader into it, the first the one of the same integers
# with its scales spelled out in fp32 (int5h's second: int8h, its integers as int8s under the same
# fp16s, where a Q5_0 q/k beside a Q8_0 v fuse at 34 bytes a block instead of int8k's 44); int2k's
# and int8k's int8km, whose offset per half holds int2k's mins (int8k's one offset per block
# cannot).
_WIDENED = {
    **{fmt: [(wider, _super_scaled_widener(wider))] for fmt, wider in _SUPER_WIDER.items()},
    "int2k": [("int8km", _int2k_as_int8km)],
    "int8h": [("int8", _fp16_scaled_widener("int8", None))],
    "int5h": [("int5", _fp16_scaled_widener("int5", -16.0)), ("int8h", _int5h_as_int8h)],
    "int8k": [("int8km", _int8k_as_int8km)],
}


def _holders(fmt: str) -> list[str]:
    """The formats that hold ``fmt``'s values exactly: itself, those it widens into (and theirs),
    and int8k (but for int2k and int8km) and int8km."""
    holders = [fmt]
    for wider, _ in _WIDENED.get(fmt, []):
        holders += [f for f in _holders(wider) if f not in holders]
    return holders if "int8km" in holders else [*holders, *_holders("int8k")]


# A format asked for (a --quantization mode's) and the narrower one whose blocks from a file then
# load as they are: int8's int8h (Q8_0's fp16 scales).
NARROWER = {"int8": "int8h"}


def as_format(weight: QuantizedWeight, fmt: str) -> QuantizedWeight:
    """``weight`` in ``fmt``, the same values: every format but int2k converts into int8k exactly
    (both halves' scale the block's d, int6's its own two; the offset 0 or m; the integers as
    int8, int6's less 32; int4k by way of int4's records, int5k and int5h of int5's, int8h of
    int8's), and so into int8km (the offset each half's), which int2k converts into (its halves'
    D * sc and M * mc spelled out); int4k into int4, int5k and int5h into int5, int8h into int8
    (their scales spelled out in fp32), int5h into int8h and so int8 (its integers less 16 as
    int8s)."""
    if weight.fmt == fmt:
        return weight
    if fmt not in _holders(weight.fmt):
        raise ValueError(f"{weight.fmt} weights do not convert into {fmt}")
    n, blocks = weight.out_features, weight.in_features // BLOCK
    for wider, widen in _WIDENED.get(weight.fmt, []):
        if fmt in _holders(wider):  # int8k is among every one's: the first reader takes it there
            return as_format(widen(weight.records, n, blocks), fmt)
    records = weight.records
    scale = records[:, : 4 * blocks]
    no_offset = torch.zeros(n, 4 * blocks, dtype=torch.uint8)
    if weight.fmt == "int8":
        parts = [scale, scale, no_offset, records[:, 4 * blocks :]]
    elif weight.fmt == "int6":
        q = _unsigned_values(weight.fmt, records[:, 8 * blocks :], n, blocks).to(torch.int8) - 32
        parts = [scale, records[:, 4 * blocks : 8 * blocks], no_offset, q.view(torch.uint8)]
    else:
        q = _unsigned_values(weight.fmt, records[:, 8 * blocks :], n, blocks)
        parts = [scale, scale, records[:, 4 * blocks : 8 * blocks], q]
    records = torch.cat([p.reshape(n, -1) for p in parts], dim=1)
    return as_format(QuantizedWeight("int8k", weight.in_features, records), fmt)


def concatenate(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the stacked output columns of ``weights`` (same K): in their format; where
    they differ, in the narrowest one that holds them all (int8h and int8 in int8; int5h, int5k
    and int5 in int5; int5h and int8h in int8h), else in int8k, or int8km where a part is int2k
    (each part converted exactly), so mixed projections still fuse."""
    first = weights[0]
    if any(w.in_features != first.in_features for w in weights):
        raise ValueError("only weights of one input width concatenate")
    common = set.intersection(*(set(_holders(w.fmt)) for w in weights))
    fmt = min(common, key=lambda f: (record_bytes(f, first.in_features), f))
    if any(w.records.is_meta for w in weights):  # described only (narrow_cache): the same
        rows = sum(w.out_features for w in weights)
        return described(fmt, rows, first.in_features)
    records = [as_format(w, fmt).records for w in weights]
    return QuantizedWeight(fmt, first.in_features, torch.cat(records))


def described(fmt: str, n: int, k: int) -> QuantizedWeight:
    """A weight [n, k] in ``fmt`` whose records are only described (on the meta device): what a
    load builds for a weight whose kernel layout it maps from the packed cache."""
    return QuantizedWeight(
        fmt, k, torch.empty((n, record_bytes(fmt, k)), dtype=torch.uint8, device="meta")
    )


def quantizable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """``weight`` [N, K] (K a multiple of BLOCK) into ``fmt``, rounding to nearest (GGUF's
    reference quantisers' rules)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not quantizable(weight):
        raise ValueError(f"a [{', '.join(map(str, weight.shape))}] weight is not in blocks of 32")
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt in ("int8", "int8h"):
        scale = blocks.abs().amax(-1, keepdim=True) / 127.0
        q = torch.round(blocks * _inverse(scale)).clamp(-128, 127).to(torch.int8)
        # int8h: q against the fp32 d, which is then stored rounded to fp16, as Q8_0's quantiser
        parts = [scale if fmt == "int8" else scale.half(), q]
    elif fmt == "int5h":
        # Q5_0's quantiser: d the block's value of largest magnitude over -16 (that value's q 0),
        # q against the fp32 d, d stored rounded to fp16
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        scale = extreme / -16.0
        q = torch.round(blocks * _inverse(scale) + 16).clamp(0, 31).to(torch.int32)
        parts = [scale.half(), *_unsigned_parts("int5", q)]
    elif fmt in ("int4", "int5"):
        levels = 15 if fmt == "int4" else 31
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        scale = (high - low) / levels
        q = torch.round((blocks - low) * _inverse(scale)).clamp(0, levels).to(torch.int32)
        parts = [scale, low, *_unsigned_parts(fmt, q)]
    elif fmt in _SUPER_SCALED:
        return _quantize_super_scaled(fmt, blocks, n, k)
    elif fmt == "int6":
        halves = blocks.view(n, k // BLOCK, 2, HALF)
        scale = halves.abs().amax(-1, keepdim=True) / 31.0  # [n, blocks, 2 halves, 1]
        q = torch.round(halves * _inverse(scale)).clamp(-32, 31).to(torch.int32) + 32
        parts = [
            scale[:, :, 0],
            scale[:, :, 1],
            *_unsigned_parts(fmt, q.view(n, k // BLOCK, BLOCK)),
        ]
    else:  # int8k, int8km: centred per block (int8km: per half), each half scaled symmetrically
        halves = blocks.view(n, k // BLOCK, 2, HALF)
        spans = halves if fmt == "int8km" else blocks[:, :, None]
        offset = (spans.amin(-1, keepdim=True) + spans.amax(-1, keepdim=True)) / 2
        centred = halves - offset
        scale = centred.abs().amax(-1, keepdim=True) / 127.0  # [n, blocks, 2 halves, 1]
        q = torch.round(centred * _inverse(scale)).clamp(-127, 127).to(torch.int8)
        parts = [scale[:, :, 0], scale[:, :, 1], *offset.unbind(2), q]
    return QuantizedWeight(fmt, k, _records(n, parts))


def _quantize_super_scaled(fmt: str, blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """[n, k / 32, 32] into int4k, int5k (int2k) as Q4_K's, Q5_K's (Q2_K's) layout allows: each
    block's (half-block's) offset its minimum (taken to at most 0: M <= 0, mc >= 0), its scale its
    range over the integers' largest, both then rounded to 6 (4) bits of their super-block's
    largest; q rounded against the scales so made."""
    levels, scale_levels, span = _SUPER_SCALED[fmt]
    units, per_super = k // span, SUPER * BLOCK // span
    values = blocks.reshape(n, units, span)
    low = values.amin(-1).clamp(max=0.0)
    scale = (values.amax(-1) - low) / levels
    pad = _supers(k // BLOCK) * per_super - units
    big_d, big_m = (
        torch.nn.functional.pad(v, (0, pad)).view(n, -1, per_super) for v in (scale, low)
    )
    big_d, big_m = big_d.amax(-1) / scale_levels, big_m.amin(-1) / scale_levels

    def per_unit(v: torch.Tensor) -> torch.Tensor:
        return v.repeat_interleave(per_super, -1)[:, :units]

    sc = torch.round(scale * per_unit(_inverse(big_d))).clamp(0, scale_levels)
    mc = torch.round(low * per_unit(_inverse(big_m))).clamp(0, scale_levels)
    d, m = per_unit(big_d) * sc, per_unit(big_m) * mc
    q = torch.round((values - m[..., None]) * _inverse(d)[..., None]).clamp(0, levels)
    return _super_scaled(fmt, n, k, big_d, big_m, sc, mc, q.to(torch.int32))


def _super_scaled(
    fmt: str,
    n: int,
    k: int,
    big_d: torch.Tensor,
    big_m: torch.Tensor,
    sc: torch.Tensor,
    mc: torch.Tensor,
    q: torch.Tensor,
) -> QuantizedWeight:
    """int2k, int4k or int5k records of D and M (fp32 [n, supers, ...]), sc and mc (integers of
    the format's range, one per block or, int2k's, half-block: [n, units, ...]) and the integers
    ``q`` ([n, k / 32, 32] or of the same elements): int4k's and int5k's sc, then mc, a byte each
    per block; int2k's a byte per half-block (sc | mc << 4), its first halves', then its second's,
    then its 2-bit integers (`_upper_values`' layout)."""
    q = q.reshape(n, k // BLOCK, BLOCK).to(torch.int32)
    if fmt == "int2k":
        halves = (sc.to(torch.int32) | (mc.to(torch.int32) << 4)).reshape(n, k // BLOCK, 2)
        ints = [halves[..., 0].to(torch.uint8), halves[..., 1].to(torch.uint8)]
        return QuantizedWeight(fmt, k, _records(n, [big_d, big_m, *ints, _packed_fields(q, 2)]))
    ints = [sc.to(torch.uint8), mc.to(torch.uint8)]
    parts = [big_d, big_m, *ints, *_unsigned_parts(_SUPER_WIDER[fmt], q)]
    return QuantizedWeight(fmt, k, _records(n, parts))


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, 0 where the scale is 0 (int4k's and int5k's M and int5h's d may be negative)."""
    return torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))


def _unsigned_parts(fmt: str, q: torch.Tensor) -> list[torch.Tensor]:
    """int4, int5 or int6 integers ([n, blocks, 32] int32) as their records' parts: the nibbles,
    then the bits above them (`_upper_values`' layout)."""
    nibbles = ((q[..., :HALF] & 0x0F) | ((q[..., HALF:] & 0x0F) << 4)).to(torch.uint8)
    if fmt == "int4":
        return [nibbles]
    return [nibbles, _packed_fields(q >> 4, _UPPER_BITS[fmt])]


def _packed_fields(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integers of ``width`` bits ([..., 32] int32) packed as `_upper_values` reads them."""
    fields = values.reshape(*values.shape[:-1], 4 * width, 8 // width)
    shifts = torch.arange(0, 8, width, dtype=torch.int32)
    return (fields << shifts).sum(-1).to(torch.uint8)


def _records(n: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """Column records from per-column parts (each [n, blocks, ...]), laid end to end as bytes."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], dim=1)


def from_gguf_blocks(block_type: str, raw: np.ndarray, k: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (``raw`` [N, bytes per row] uint8, as gguf's reader maps them)
    in the format that holds them exactly."""
    fmt, elements, block_bytes = GGUF_BLOCKS[block_type]
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(n, k // elements, block_bytes)  # a writable copy
    if block_type in _SUPER_BLOCKS:
        return _SUPER_BLOCKS[block_type](blocks, n, k)
    scale = _fp16(blocks[..., :2])
    # the nibbles and Q5's fifth bits are laid out as the records hold them: copied as they are
    if block_type == "Q8_0":  # int8h: the scale as the file's fp16
        parts = [blocks[..., :2], blocks[..., 2:]]
    elif block_type == "Q5_0":  # int5h: the scale as the file's fp16, the offset -16 d implied
        parts = [blocks[..., :2], blocks[..., 6:], blocks[..., 2:6]]
    elif block_type == "Q4_1":
        parts = [scale, _fp16(blocks[..., 2:4]), blocks[..., 4:]]
    elif block_type == "Q4_0":
        parts = [scale, -8.0 * scale, blocks[..., 2:]]
    elif block_type == "IQ4_NL":
        parts = [blocks[..., :2], _nonlinear_values(blocks[..., 2:])]
    else:  # Q5_1
        parts = [scale, _fp16(blocks[..., 2:4]), blocks[..., 8:], blocks[..., 4:8]]
    return QuantizedWeight(fmt, k, _records(n, parts))


# IQ4_NL's and IQ4_XS's 16 values, which their 4-bit indices pick (ggml's kvalues_iq4nl).
_NONLINEAR = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8
)


def _nonlinear_values(nibbles: torch.Tensor) -> torch.Tensor:
    """IQ4's int8 values [..., 32] of 16 bytes of indices [..., 16] (low nibbles elements 0-15,
    high 16-31)."""
    return _NONLINEAR[_bits(nibbles, range(0, 8, 4), 4).flatten(-2).long()]


def _iq4_xs(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """IQ4_XS super-blocks [n, k / 256, 136]: d fp16, 2 bytes of the 8 scales' high 2-bit pairs
    (shift 2 j: sub-block j's), 4 of their low nibbles (low nibble of byte t: sub-block 2 t, high:
    2 t + 1), then 16 bytes of indices per sub-block of 32; int8 of scale d * (sc - 32)."""
    d = _fp16(blocks[..., 0:2])
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32)
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [n, supers, 8]
    low = _bits(blocks[..., 4:8], range(0, 8, 4), 4).transpose(-1, -2).flatten(-2)
    scale = (d * ((low | (high << 4)) - 32).float()).reshape(n, k // BLOCK, 1)
    values = _nonlinear_values(blocks[..., 8:].reshape(n, k // BLOCK, HALF))
    return QuantizedWeight("int8", k, _records(n, [scale, values]))


def _fp16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes read as fp16, widened to fp32 [..., 1]."""
    return pairs.contiguous().view(torch.float16).float()


def _bits(packed: torch.Tensor, shifts: range, width: int) -> torch.Tensor:
    """Fields of ``width`` bits of bytes [..., L] at ``shifts``: [..., len(shifts), L] int32, the
    fields of each shift in a row (GGUF's element order)."""
    shift = torch.tensor(shifts, dtype=torch.int32)[:, None]
    return (packed.to(torch.int32)[..., None, :] >> shift) & ((1 << width) - 1)


def _upper_values(upper: torch.Tensor, width: int) -> torch.Tensor:
    """int5's fifth bits (width 1: bit i of the little-endian uint32 element i's, Q5_0 and Q5_1's
    order) or int6's high bit pairs (width 2: bits 2 (i % 4) of byte i / 4), 4 * width bytes a
    block, as int32 [..., 32]."""
    return _bits(upper, range(0, 8, width), width).transpose(-1, -2).flatten(-2)


def _int8k(
    n: int, k: int, scales: torch.Tensor, offsets: torch.Tensor, q: torch.Tensor
) -> QuantizedWeight:
    """int8k records of ``scales`` (one per 16 inputs, [n, ..., k / 16]), ``offsets`` (one per 32)
    and the int8s ``q`` ([n, ..., k])."""
    halves = scales.reshape(n, k // BLOCK, 2)
    parts = [halves[..., 0], halves[..., 1], offsets.reshape(n, -1), q.reshape(n, -1)]
    return QuantizedWeight("int8k", k, _records(n, parts))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks: (sc, m) int32 [..., 8]."""
    packed = packed.to(torch.int32)
    sc = torch.cat(
        [packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], -1
    )
    m = torch.cat(
        [packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1
    )
    return sc, m


def _k_quants(fmt: str, blocks: torch.Tensor, n: int, k: int, q: torch.Tensor) -> QuantizedWeight:
    """Q4_K or Q5_K super-blocks [n, k / 256, ...] (d, dmin fp16, then 12 bytes of 6-bit scales
    and mins for 8 sub-blocks) with their integers ``q`` [n, k] as int4k or int5k records: D = d,
    M = -dmin, sc and mc the sub-blocks'."""
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    return _super_scaled(fmt, n, k, d, -dmin, sc, m, q.reshape(n, k // BLOCK, BLOCK))


def _k_nibbles(qs: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q4_K's and Q5_K's 128 bytes of nibbles per super-block ([n, k / 256, 128]; 32 per pair of
    sub-blocks: low nibbles the first's 32, high the second's) as int32 [n, k]."""
    return _bits(qs.reshape(n, k // 256, 4, 32), range(0, 8, 4), 4).reshape(n, k)


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q4_K super-blocks [n, k / 256, 144]: d, dmin, scales (`_k_quants`), 128 bytes of nibbles
    (`_k_nibbles`); int4k."""
    return _k_quants("int4k", blocks, n, k, _k_nibbles(blocks[..., 16:], n, k))


def _q5_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q5_K super-blocks [n, k / 256, 176]: Q4_K's d, dmin and scales, then 32 bytes of fifth
    bits (bit j of byte t: element 32 j + t) and 128 of nibbles as Q4_K's; int5k."""
    high = _bits(blocks[..., 16:48], range(8), 1).reshape(n, k)
    return _k_quants("int5k", blocks, n, k, _k_nibbles(blocks[..., 48:], n, k) | (high << 4))


def _q6_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q6_K super-blocks [n, k / 256, 210]: 128 bytes of low nibbles (per half of 128 elements,
    64 bytes: low nibbles its first 64, high its next), 64 of high 2-bit pairs (per half, 32
    bytes: the pair at shift 2 j element 32 j + t), 16 int8 scales (one per 16) and d fp16;
    int6 of scales d * sc."""
    supers = k // 256
    low = _bits(blocks[..., :128].reshape(n, supers, 2, 64), range(0, 8, 4), 4)
    high = _bits(blocks[..., 128:192].reshape(n, supers, 2, 32), range(0, 8, 2), 2)
    values = (low.reshape(n, k) | (high.reshape(n, k) << 4)).reshape(n, k // BLOCK, BLOCK)
    scales = _fp16(blocks[..., 208:210]) * blocks[..., 192:208].view(torch.int8).float()
    halves = scales.reshape(n, k // BLOCK, 2)
    parts = [halves[..., 0], halves[..., 1], *_unsigned_parts("int6", values)]
    return QuantizedWeight("int6", k, _records(n, parts))


def _q2_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q2_K super-blocks [n, k / 256, 84]: 16 bytes of a scale (low nibble) and a min (high) per
    16 elements, 64 of 2-bit integers (per half of 128, 32 bytes: shift 2 j is element 32 j + t),
    d and dmin fp16; int2k: D = d, M = -dmin, the scale bytes as they are."""
    supers = k // 256
    scales = blocks[..., :16].reshape(n, supers, 8, 2).to(torch.int32)
    q = _bits(blocks[..., 16:80].reshape(n, supers, 2, 32), range(0, 8, 2), 2).reshape(n, k)
    d, dmin = _fp16(blocks[..., 80:82]), _fp16(blocks[..., 82:84])
    return _super_scaled("int2k", n, k, d, -dmin, scales & 0x0F, scales >> 4, q)


def _q3_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q3_K super-blocks [n, k / 256, 110]: 32 bytes of high bits (bit j of byte t: element
    32 j + t, set meaning no -4), 64 of 2-bit fields (per half of 128, 32 bytes: shift 2 j is
    element 32 j + t), 12 of 6-bit scales (low nibbles of bytes 0-7 then their high nibbles,
    above them 2-bit pairs of bytes 8-11: shift 2 j is scale 4 j + byte) and d fp16; int8k of
    scales d * (sc - 32), offset 0, q = low - 4 (1 - high bit)."""
    supers = k // 256
    low_sc = _bits(blocks[..., 96:104], range(0, 8, 4), 4).flatten(-2)
    high_sc = _bits(blocks[..., 104:108], range(0, 8, 2), 2).flatten(-2)
    scales = _fp16(blocks[..., 108:110]) * ((low_sc | (high_sc << 4)) - 32).float()
    low = _bits(blocks[..., 32:96].reshape(n, supers, 2, 32), range(0, 8, 2), 2)
    high = _bits(blocks[..., :32], range(8), 1)
    values = (low.reshape(n, k) - 4 * (1 - high.reshape(n, k))).to(torch.int8)
    return _int8k(n, k, scales, torch.zeros(n, k // BLOCK), values)


# The block types of 256-element super-blocks, by their readers.
_SUPER_BLOCKS = {
    "Q2_K": _q2_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q3_K": _q3_k,
    "IQ4_XS": _iq4_xs,
}
