"""Paged KV block manager: sequences' block tables, on-demand allocation, prefix caching and
copy-on-write, over a BlockPool (engine/core/block_pool.py: each block's state, ref counts, the free
list, the LRU of cached blocks and the hash map).

Full blocks are keyed by a chained SHA-256 (previous block's digest + this block's token ids), so a
hit means the whole prefix up to and including that block is identical; a strong hash makes a
silent collision practically impossible without storing and comparing token ids.
"""

from __future__ import annotations

import hashlib
import weakref
from array import array

from engine.core.block_pool import BlockPool
from engine.core.sequence import Sequence

_ROOT_HASH = b""


def chain_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    """Digest identifying a full block by its tokens and everything before it."""
    return hashlib.sha256(prev_hash + array("q", token_ids).tobytes()).digest()


class _SeqBlockState:
    """Per-sequence bookkeeping the manager keeps out of the shared Sequence type."""

    __slots__ = ("hashes", "num_committed")

    def __init__(self) -> None:
        self.hashes: list[bytes] = []  # chained hashes of the first full blocks of token_ids
        self.num_committed = 0  # leading blocks of block_table already offered to the cache


class BlockManager:
    """Hands out KV blocks to sequences; all operations are O(1) per block touched."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.pool = BlockPool(num_blocks)
        self._copies: dict[int, int] = {}  # pending copy-on-write, dst -> src, in issue order
        # Keyed by the Sequence object and dropped with it: hashes stay valid across preemption
        # because a sequence's tokens only ever grow.
        self._state: weakref.WeakKeyDictionary[Sequence, _SeqBlockState] = (
            weakref.WeakKeyDictionary()
        )
        # (queries, hits) of a lookup, counted once the sequence gets its slots, so a
        # head-of-line request retried every step counts once. Held only until then or free().
        self._pending_lookups: dict[Sequence, tuple[int, int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus evictable cached ones."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding a reusable prefix."""
        return self.pool.num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _seq_state(self, seq: Sequence) -> _SeqBlockState:
        state = self._state.get(seq)
        if state is None:
            state = self._state[seq] = _SeqBlockState()
        return state

    def _block_hash_of(self, seq: Sequence, state: _SeqBlockState, index: int) -> bytes:
        """Chained hash of full block ``index`` of seq's tokens, computed once per sequence."""
        hashes = state.hashes
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            prev = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(chain_hash(prev, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[index]

    def _release(self, block: int) -> None:
        if self.pool.release(block):
            self._copies.pop(block, None)  # a copy into a block nobody holds is moot

    def match_prefix(self, seq: Sequence) -> None:
        """Attach cached full blocks for seq's longest cached prefix (on admission or re-admission).

        At least one token is always left to compute, so the model produces the logits of the
        last token. Sets ``num_computed_tokens`` and ``num_cached_tokens`` (capped to the prompt).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, "seq already holds blocks"
        if not self.enable_prefix_caching:
            seq.num_cached_tokens = 0
            return
        state = self._seq_state(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            block = self.pool.lookup(self._block_hash_of(seq, state, i))
            if block is None:
                break
            self.pool.acquire(block)
            seq.block_table.append(block)
        matched = len(seq.block_table) * self.block_size
        state.num_committed = len(seq.block_table)
        self._pending_lookups[seq] = (seq.num_tokens, matched)
        seq.num_computed_tokens = matched
        seq.num_cached_tokens = min(matched, seq.num_prompt_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's block table cover its next ``num_new_tokens`` tokens.

        Blocks about to be written that other sequences share are copied first (copy-on-write).
        Returns False, changing nothing, when not enough blocks can be had.
        """
        table = seq.block_table
        bs = self.block_size
        computed = seq.num_computed_tokens
        end = -(-(computed + num_new_tokens) // bs)  # blocks needed in all
        have = len(table)
        pool = self.pool
        # Only the blocks this step writes into can need a copy (usually none or one).
        shared = [i for i in range(computed // bs, min(end, have)) if pool.ref_count(table[i]) > 1]
        if max(0, end - have) + len(shared) > pool.num_free:
            return False
        for i in shared:
            src = table[i]
            dst = pool.take()
            self._copies[dst] = src
            pool.release(src)  # not its last reference: someone else holds it
            table[i] = dst
        while len(table) < end:
            table.append(pool.take())
        if self._pending_lookups:
            queries, hits = self._pending_lookups.pop(seq, (0, 0))
            self.prefix_cache_queries += queries
            self.prefix_cache_hits += hits
        return True

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Pending (src_block, dst_block) copies to apply before the next forward, in order."""
        ops = [(src, dst) for dst, src in self._copies.items()]
        self._copies.clear()
        return ops

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self._seq_state(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(state.num_committed, num_full):
            self.pool.offer(seq.block_table[i], self._block_hash_of(seq, state, i))
        state.num_committed = max(state.num_committed, num_full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make child share all of parent's blocks (each gains a reference)."""
        assert not child.block_table, "child already holds blocks"
        for block in parent.block_table:
            self.pool.acquire(block)
        child.block_table = list(parent.block_table)
        parent_state = self._state.get(parent)
        if parent_state is not None:
            child_state = self._seq_state(child)
            child_state.hashes = list(parent_state.hashes)
            child_state.num_committed = parent_state.num_committed

    def reset(self) -> None:
        """Every block free and no prefix cached, for pools that were freed and reallocated (a
        sleep): the cached blocks' contents are gone. Only while no sequence holds a block (a
        pending copy's destination is held too)."""
        self.pool.reset()

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; hashed blocks stay reusable until evicted.

        Released last block first, so a prefix's head is evicted after its tail.
        """
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        self._pending_lookups.pop(seq, None)
        state = self._state.get(seq)
        if state is not None:
            state.num_committed = 0
