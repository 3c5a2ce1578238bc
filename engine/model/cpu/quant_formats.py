"""Narrow weight formats of the CPU linears: quantising fp32 weights into them, reading GGUF's own
blocks into them, and the torch reference that turns them back into fp32.

Both formats work in blocks of 32 consecutive inputs of one output column, GGUF's block size:

- ``int8``: ``w = d * q``, q in [-128, 127], one fp32 scale per block (symmetric, d = max|w| / 127:
  GGUF's Q8_0, whose blocks load exactly).
- ``int4``: ``w = d * q + m``, q in [0, 15], an fp32 scale and offset per block (d = (max - min) /
  15, m = min: GGUF's Q4_1; Q4_0's ``d * (q - 8)`` is the same with m = -8 d, so both load exactly).

A weight [N, K] is held as N column records of `record_bytes` bytes each ([N, bytes] uint8):
the scales, then (int4) the offsets, then the integers (int4: 16 bytes a block, the low nibbles
elements 0-15 and the high nibbles 16-31, GGUF's order). Records of the same K concatenate, so
fused projections are a torch.cat; rows permute with an index (kernels/quant_gemm.c reads them).

GGUF block types each format holds exactly (`GGUF_BLOCKS`): Q8_0 and Q5_0 (``d * (q - 16)``,
q 5 bits) in int8; Q4_1, Q4_0 and Q4_K in int4, whose super-blocks of 256 carry 6-bit scales
and offsets per 32 (``d * sc * q - dmin * m``: d * sc and dmin * m are exact in fp32, being
fp16 times 6-bit integers). GGUF stores its scales in fp16; widening them to fp32 is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
FORMATS = ("int8", "int4")
# GGUF block types that load into a format as they are: (format, elements and bytes per block).
GGUF_BLOCKS = {
    "Q8_0": ("int8", 32, 34),
    "Q5_0": ("int8", 32, 22),
    "Q4_1": ("int4", 32, 20),
    "Q4_0": ("int4", 32, 18),
    "Q4_K": ("int4", 256, 144),
}


def record_bytes(fmt: str, k: int) -> int:
    """Bytes of one output column's record for ``k`` inputs (a multiple of BLOCK)."""
    blocks = k // BLOCK
    return blocks * (8 + BLOCK // 2) if fmt == "int4" else blocks * (4 + BLOCK)


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
        scales = records[:, : 4 * blocks].contiguous().view(torch.float32)[..., None]
        if self.fmt == "int8":
            q = records[:, 4 * blocks :].contiguous().view(torch.int8).view(n, blocks, BLOCK)
            return (scales * q.float()).view(n, self.in_features)
        offsets = records[:, 4 * blocks : 8 * blocks].contiguous().view(torch.float32)[..., None]
        packed = records[:, 8 * blocks :].view(n, blocks, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        return (scales * q + offsets).view(n, self.in_features)


def concatenate(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the stacked output columns of ``weights`` (same format and K)."""
    first = weights[0]
    if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
        raise ValueError("only weights of one format and input width concatenate")
    return QuantizedWeight(first.fmt, first.in_features, torch.cat([w.records for w in weights]))


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
    if fmt == "int8":
        scale = blocks.abs().amax(-1, keepdim=True) / 127.0
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(blocks * inverse).clamp(-128, 127).to(torch.int8)
        parts = [scale, q]
    else:
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        scale = (high - low) / 15.0
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round((blocks - low) * inverse).clamp(0, 15).to(torch.uint8)
        parts = [scale, low, q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)]
    return QuantizedWeight(fmt, k, _records(n, parts))


def _records(n: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """Column records from per-column parts (each [n, blocks, ...]), laid end to end as bytes."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], dim=1)


def from_gguf_blocks(block_type: str, raw: np.ndarray, k: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (``raw`` [N, bytes per row] uint8, as gguf's reader maps them)
    in the format that holds them exactly."""
    fmt, elements, block_bytes = GGUF_BLOCKS[block_type]
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(n, k // elements, block_bytes)  # a writable copy
    scale = _fp16(blocks[..., :2])
    if block_type == "Q8_0":
        return QuantizedWeight(fmt, k, _records(n, [scale, blocks[..., 2:]]))
    if block_type == "Q5_0":
        return QuantizedWeight(fmt, k, _records(n, [scale, _q5_0_values(blocks)]))
    if block_type == "Q4_1":
        return QuantizedWeight(
            fmt, k, _records(n, [scale, _fp16(blocks[..., 2:4]), blocks[..., 4:]])
        )
    if block_type == "Q4_0":
        return QuantizedWeight(fmt, k, _records(n, [scale, -8.0 * scale, blocks[..., 2:]]))
    return _q4_k(blocks, n, k)


def _fp16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes read as fp16, widened to fp32 [..., 1]."""
    return pairs.contiguous().view(torch.float16).float()


def _q5_0_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0's integers q - 16 as int8 [n, blocks, 32]: the low 4 bits in nibbles (elements 0-15
    low, 16-31 high), the fifth bits in a little-endian uint32."""
    high = blocks[..., 2:6].contiguous().view(torch.int32)  # [n, blocks, 1]
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    nibbles = blocks[..., 6:].to(torch.int32)
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
    return (low | (bits << 4)).sub(16).to(torch.int8)


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    """Q4_K super-blocks [n, k / 256, 144] (d, dmin fp16; 12 bytes of 6-bit scales and mins for
    8 sub-blocks; 128 bytes of nibbles, 32 per pair of sub-blocks: low nibbles the first's 32,
    high the second's) as int4 records: per sub-block scale d * sc, offset -dmin * m."""
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    packed = blocks[..., 4:16].to(torch.int32)
    sc = torch.cat(
        [packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], -1
    )
    m = torch.cat(
        [packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1
    )
    scale = (d * sc.float()).reshape(n, k // BLOCK, 1)
    offset = (-(dmin * m.float())).reshape(n, k // BLOCK, 1)
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)
    values = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k // BLOCK, BLOCK)
    nibbles = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)
    return QuantizedWeight("int4", k, _records(n, [scale, offset, nibbles]))
