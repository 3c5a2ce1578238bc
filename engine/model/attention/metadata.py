"""The batch layout of one engine step as every layer's attention call reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one engine step, shared by every layer's attention call."""

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (flattened batch order)
    query_start_loc: torch.Tensor  # [B+1] int32 cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32 context length of each seq AFTER this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Index and mask tensors derived from the layout, built by the first layer and reused by the
    # others (keyed by what they depend on, e.g. the sliding window).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def slots_within(self, num_slots: int) -> bool:
        """Whether every slot of the step lies in [0, num_slots), checked once per step: the C
        kernels write K/V into the pools without bounds checks."""
        key = ("slots_within", num_slots)
        within = self.derived.get(key)
        if within is None:
            slots = self.slot_mapping
            within = self.derived[key] = bool(
                slots.numel() and int(slots.min()) >= 0 and int(slots.max()) < num_slots
            )
        return within

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata of a flattened batch from host lists.

        Sequence i contributes query_lens[i] new tokens at positions
        seq_lens[i] - query_lens[i] .. seq_lens[i] - 1; block_tables[i] must cover seq_lens[i].
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty, same length")
        # Host lists, then one tensor each: the ~15 small torch ops this replaced cost more per
        # step than this Python walk over the new tokens (docs/PERFORMANCE.md#step-bookkeeping).
        slots: list[int] = []
        starts = [0]
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(
                    f"bad sequence layout: q_len={q_len} seq_len={s_len} "
                    f"blocks={len(table)} block_size={block_size}"
                )
            for position in range(s_len - q_len, s_len):
                slots.append(table[position // block_size] * block_size + position % block_size)
            starts.append(starts[-1] + q_len)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
