"""KV cache sizing and allocation: per-layer K and V block pools."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.errors import CacheTooSmallError
from engine.model.cpu.huge_pages import HugePageArena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's pool, minus the block count."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, max_model_len: int) -> int:
    """Blocks fitting in ``budget_bytes``; CacheTooSmallError if one max-length sequence won't."""
    num_blocks = max(0, budget_bytes) // spec.bytes_per_block
    needed = spec.blocks_for_tokens(max_model_len)
    if num_blocks < needed:
        raise CacheTooSmallError(
            f"KV cache budget of {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of "
            f"{spec.block_size} tokens ({spec.bytes_per_block / 2**10:.1f} KiB each), but one "
            f"max_model_len={max_model_len} sequence needs {needed}: raise the KV budget "
            "(kv_cache_memory / gpu_memory_fraction) or lower max_model_len"
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB), max concurrency at max_model_len=%d: %.1f",
        num_blocks,
        spec.block_size,
        num_blocks * spec.bytes_per_block / 2**20,
        max_model_len,
        num_blocks / needed,
    )
    return num_blocks


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) pools per layer, each [num_blocks, block_size, kv_heads, head_dim]; on CPU
    carved from one mapping advised for huge pages and zeroed here, which commits the memory now:
    2 MiB pages fault 512 times less often than 4 KiB ones, which a wake (engine.model.park)
    pays for all pools at once, and spare attention's reads TLB misses."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type != "cpu" or num_blocks == 0:
        return [
            (
                torch.zeros(shape, dtype=spec.dtype, device=device),
                torch.zeros(shape, dtype=spec.dtype, device=device),
            )
            for _ in range(spec.num_layers)
        ]
    numel = num_blocks * spec.block_size * spec.num_kv_heads * spec.head_dim
    arena = HugePageArena(chunk_bytes=2 * spec.num_layers * numel * spec.dtype.itemsize)

    def pool() -> torch.Tensor:
        return arena.empty(numel, spec.dtype).view(shape).zero_()

    return [(pool(), pool()) for _ in range(spec.num_layers)]
