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
GGUF stores the scales in fp16; widening them to fp32 is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
FORMATS = ("int8", "int4")
# GGUF block types that load into a format as they are: (format, bytes per block).
GGUF_BLOCKS = {"Q8_0": ("int8", 34), "Q4_1": ("int4", 20), "Q4_0": ("int4", 18)}


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
    fmt, block_bytes = GGUF_BLOCKS[block_type]
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(n, k // BLOCK, block_bytes)  # a writable copy
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    if block_type == "Q8_0":
        return QuantizedWeight(fmt, k, _records(n, [scale, blocks[..., 2:]]))
    if block_type == "Q4_1":
        offset = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return QuantizedWeight(fmt, k, _records(n, [scale, offset, blocks[..., 4:]]))
    return QuantizedWeight(fmt, k, _records(n, [scale, -8.0 * scale, blocks[..., 2:]]))
