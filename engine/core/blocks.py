"""Paged KV block manager: on-demand allocation, ref counts, prefix caching and copy-on-write.

Every block is in exactly one state:
- free: ref count 0, no hash, in ``_free``;
- cached: ref count 0 but holding a full block's hash, in ``_lru`` (reusable on a prefix hit,
  evicted least recently used first when a new block is needed);
- referenced: ref count == number of occurrences in live sequences' block tables.

Full blocks are keyed by a chained SHA-256 (previous block's digest + this block's token ids), so a
hit means the whole prefix up to and including that block is identical; a strong hash makes a
silent collision practically impossible without storing and comparing token ids.
"""

from __future__ import annotations

import hashlib
import weakref
from array import array
from collections import OrderedDict, deque

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
        self._ref = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block holding it
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
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding a reusable prefix."""
        return len(self._lru)

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

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)
            del self._cached[self._block_hash[block]]  # type: ignore[index]
            self._block_hash[block] = None
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._copies.pop(block, None)  # a copy into a block nobody holds is moot
            if self._block_hash[block] is None:
                self._free.append(block)
            else:
                self._lru[block] = None

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
            block = self._cached.get(self._block_hash_of(seq, state, i))
            if block is None:
                break
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1
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
        ref = self._ref
        # Only the blocks this step writes into can need a copy (usually none or one).
        shared = [i for i in range(computed // bs, min(end, have)) if ref[table[i]] > 1]
        if max(0, end - have) + len(shared) > len(self._free) + len(self._lru):
            return False
        for i in shared:
            src = table[i]
            dst = self._take_block()
            self._copies[dst] = src
            self._ref[src] -= 1  # still > 0: someone else holds it
            table[i] = dst
        while len(table) < end:
            table.append(self._take_block())
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
            block_hash = self._block_hash_of(seq, state, i)
            block = seq.block_table[i]
            # An identical block may be cached already (same prefix computed twice at once);
            # keep the first and let this one become plain free when released.
            if self._block_hash[block] is None and block_hash not in self._cached:
                self._block_hash[block] = block_hash
                self._cached[block_hash] = block
        state.num_committed = max(state.num_committed, num_full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make child share all of parent's blocks (each gains a reference)."""
        assert not child.block_table, "child already holds blocks"
        for block in parent.block_table:
            self._ref[block] += 1
        child.block_table = list(parent.block_table)
        parent_state = self._state.get(parent)
        if parent_state is not None:
            child_state = self._seq_state(child)
            child_state.hashes = list(parent_state.hashes)
            child_state.num_committed = parent_state.num_committed

    def reset(self) -> None:
        """Every block free and no prefix cached, for pools that were freed and reallocated (a
        sleep): the cached blocks' contents are gone. Only while no sequence holds a block."""
        if any(self._ref) or self._copies:
            raise RuntimeError("blocks are still in use")
        self._block_hash = [None] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._lru.clear()
        self._cached.clear()

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
