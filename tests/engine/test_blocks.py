"""BlockManager over its BlockPool: on-demand allocation, ref counts, prefix caching, LRU eviction,
copy-on-write.

A fake KV pool records, in every slot written, a fingerprint of the token prefix whose K/V a real
model would store there; checking each sequence's slots against its own tokens catches wrong
sharing, missed copy-on-writes and stale prefix hits independently of the manager's bookkeeping.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from engine.core.blocks import BlockManager
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence

PARAMS = SamplingParams(max_tokens=None)


class FakeKVCache:
    """Slot -> fingerprint of the prefix whose K/V live there (stand-in for the K/V pools)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def apply_copies(self, ops: list[tuple[int, int]]) -> None:
        dsts = [dst for _, dst in ops]
        assert len(dsts) == len(set(dsts)), f"duplicate copy destinations {ops}"
        bs = self.block_size
        for src, dst in ops:
            assert src != dst
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]

    def write(self, seq: Sequence, num_new: int) -> None:
        """What the forward does: store K/V of positions computed .. computed + num_new - 1."""
        start = seq.num_computed_tokens
        assert len(seq.block_table) * self.block_size >= start + num_new, "slots not allocated"
        for pos in range(start, start + num_new):
            self.slots[self.slot(seq, pos)] = hash(tuple(seq.token_ids[: pos + 1]))

    def check(self, seq: Sequence, upto: int) -> None:
        """The K/V a forward would read for seq's first ``upto`` positions are seq's own."""
        for pos in range(upto):
            expected = hash(tuple(seq.token_ids[: pos + 1]))
            assert self.slots[self.slot(seq, pos)] == expected, f"{seq} wrong K/V at {pos}"


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, PARAMS)


def compute(bm: BlockManager, kv: FakeKVCache, seq: Sequence, num_new: int) -> None:
    """Allocate, run (fake forward) and commit ``num_new`` tokens of seq; they must fit."""
    assert bm.allocate_slots(seq, num_new)
    kv.apply_copies(bm.take_copy_ops())
    kv.write(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.commit_full_blocks(seq)


def prefill(bm: BlockManager, kv: FakeKVCache, seq: Sequence) -> None:
    bm.match_prefix(seq)
    compute(bm, kv, seq, seq.num_uncomputed_tokens)


def test_allocates_on_demand_as_sequence_grows() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, kv, seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 8
    for expected_blocks in (2, 2, 2, 3, 3, 3, 3, 4):  # decode tokens 6..13
        seq.append_token(7)
        compute(bm, kv, seq, 1)
        assert len(seq.block_table) == expected_blocks
        assert bm.num_free_blocks == 10 - expected_blocks
    kv.check(seq, seq.num_tokens)
    assert bm.usage == 0.4
    bm.free(seq)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_reset_forgets_cached_prefixes_and_refuses_while_blocks_are_held() -> None:
    """What a sleep does once its KV pools are gone: cached blocks would hold stale K/V."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    first = make_seq(0, list(range(10)))
    prefill(bm, kv, first)
    bm.free(first)
    assert bm.num_cached_blocks == 2
    bm.reset()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 10
    again = make_seq(1, list(range(10)))
    bm.match_prefix(again)
    assert again.num_cached_tokens == 0 and again.block_table == []
    compute(bm, kv, again, again.num_uncomputed_tokens)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset()


def test_allocate_fails_without_change_when_blocks_run_out() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    seq = make_seq(0, list(range(20)))
    assert not bm.allocate_slots(seq, 13)  # needs 4 blocks
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(seq, 12)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0


def test_prefix_hit_after_free_reuses_cached_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    first = make_seq(0, list(range(10)))
    prefill(bm, kv, first)
    full_blocks = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 2 and bm.usage == 0.0

    second = make_seq(1, [*range(10), 42, 43])
    bm.match_prefix(second)
    assert second.block_table == full_blocks
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    kv.check(second, 8)
    compute(bm, kv, second, second.num_uncomputed_tokens)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 12, 8)
    kv.check(second, second.num_tokens)


def test_live_blocks_are_shared_by_prefix_hits() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    first = make_seq(0, list(range(9)))
    prefill(bm, kv, first)
    second = make_seq(1, list(range(9)))
    prefill(bm, kv, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.pool.ref_count(b) for b in first.block_table] == [2, 2, 1]
    bm.free(first)
    assert [bm.pool.ref_count(b) for b in second.block_table] == [1, 1, 1]
    kv.check(second, 9)


def test_match_prefix_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    prefill(bm, kv, make_seq(0, list(range(8))))
    again = make_seq(1, list(range(8)))  # both its blocks are cached
    bm.match_prefix(again)
    assert again.num_computed_tokens == 4 and len(again.block_table) == 1
    compute(bm, kv, again, 4)
    kv.check(again, 8)


def test_hashes_are_chained_over_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    prefill(bm, kv, make_seq(0, [1, 1, 1, 1, 2, 2, 2, 2, 9]))
    other = make_seq(1, [3, 3, 3, 3, 2, 2, 2, 2, 9])  # same second block, different first
    bm.match_prefix(other)
    assert other.num_computed_tokens == 0 and other.block_table == []


def test_lru_evicts_least_recently_freed_and_tail_blocks_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    kv = FakeKVCache(6, 2)
    a = make_seq(0, [1, 1, 2, 2, 3])
    b = make_seq(1, [7, 7, 8, 8, 9])
    prefill(bm, kv, a)
    prefill(bm, kv, b)
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # Two plain free blocks go first, then a's tail block, then a's head block.
    filler = make_seq(2, [5] * 6)
    assert bm.allocate_slots(filler, 6)
    assert a_full[1] in filler.block_table and a_full[0] not in filler.block_table
    probe = make_seq(3, [1, 1, 2, 2, 3])
    bm.match_prefix(probe)  # a's head block survived, its second block was evicted
    assert probe.block_table == [a_full[0]]
    bm.free(probe)  # a's head block is now the most recently used cached block
    assert bm.allocate_slots(make_seq(4, [6] * 4), 4)
    assert bm.num_cached_blocks == 1
    survivor = make_seq(5, [1, 1, 2, 2, 3])
    bm.match_prefix(survivor)
    assert survivor.block_table == [a_full[0]]
    b_probe = make_seq(6, [7, 7, 8, 8, 9])
    bm.match_prefix(b_probe)
    assert b_probe.block_table == [] and not set(b_full) & set(survivor.block_table)


def test_copy_on_write_when_forked_sequences_write_a_shared_block() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    parent = make_seq(0, [1, 2, 3, 4, 5, 6])
    prefill(bm, kv, parent)
    child = make_seq(1, [1, 2, 3, 4, 5, 6])
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    full, partial = parent.block_table
    assert (
        child.block_table == [full, partial]
        and bm.pool.ref_count(full) == bm.pool.ref_count(partial) == 2
    )
    free_before = bm.num_free_blocks

    child.append_token(100)
    assert bm.allocate_slots(child, 1)
    ops = bm.take_copy_ops()
    new_block = child.block_table[1]
    assert ops == [(partial, new_block)] and new_block != partial
    assert (
        child.block_table[0] == full
        and bm.pool.ref_count(full) == 2
        and bm.pool.ref_count(partial) == 1
    )
    assert bm.num_free_blocks == free_before - 1
    kv.apply_copies(ops)
    kv.write(child, 1)
    child.num_computed_tokens += 1

    parent.append_token(200)
    compute(bm, kv, parent, 1)  # now the only holder of its partial block: no copy
    assert parent.block_table == [full, partial]
    kv.check(parent, 7)
    kv.check(child, 7)


def test_pending_copy_is_dropped_when_its_destination_is_freed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    kv = FakeKVCache(10, 4)
    parent = make_seq(0, [1, 2, 3])
    prefill(bm, kv, parent)
    child = make_seq(1, [1, 2, 3])
    bm.fork(parent, child)
    child.num_computed_tokens = 3
    child.append_token(9)
    assert bm.allocate_slots(child, 1)
    bm.free(child)  # e.g. aborted before the step ran
    assert bm.take_copy_ops() == []
    assert bm.num_free_blocks == 9


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    kv = FakeKVCache(4, 2)
    first = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, kv, first)
    bm.free(first)
    again = make_seq(1, [1, 2, 3, 4, 5])
    bm.match_prefix(again)
    assert again.num_computed_tokens == 0 and bm.num_cached_blocks == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_a_failed_admission_does_not_count_a_lookup() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    kv = FakeKVCache(3, 2)
    first = make_seq(0, [1, 2, 3])
    prefill(bm, kv, first)
    big = make_seq(1, [1, 2, *range(10, 20)])
    bm.match_prefix(big)
    assert big.num_computed_tokens == 2
    assert not bm.allocate_slots(big, big.num_uncomputed_tokens)
    bm.free(big)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (3, 0)  # first's lookup only
    assert bm.pool.ref_count(first.block_table[0]) == 1


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / compute / append / fork / abort / free against invariants and fake K/V."""

    NUM_BLOCKS = 12
    BLOCK_SIZE = 2

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE, enable_prefix_caching=True)
        self.kv = FakeKVCache(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []  # token lists of freed sequences, to re-admit
        self.next_id = 0

    def _new_seq(self, tokens: list[int]) -> Sequence:
        self.next_id += 1
        return make_seq(self.next_id, tokens)

    def _try_compute(self, seq: Sequence, num_new: int) -> bool:
        table, free = list(seq.block_table), self.bm.num_free_blocks
        if not self.bm.allocate_slots(seq, num_new):
            assert seq.block_table == table and self.bm.num_free_blocks == free
            return False
        self.kv.apply_copies(self.bm.take_copy_ops())
        self.kv.write(seq, num_new)
        seq.num_computed_tokens += num_new
        self.bm.commit_full_blocks(seq)
        return True

    def _admit(self, tokens: list[int], data: st.DataObject) -> None:
        seq = self._new_seq(tokens)
        self.bm.match_prefix(seq)
        assert 0 <= seq.num_computed_tokens < seq.num_tokens
        self.kv.check(seq, seq.num_computed_tokens)
        chunk = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="chunk")
        if self._try_compute(seq, chunk):
            self.live.append(seq)
        else:
            self.bm.free(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), data=st.data())
    def admit(self, tokens: list[int], data: st.DataObject) -> None:
        self._admit(tokens, data)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        """Recompute a freed (e.g. preempted) sequence's tokens: should hit its cached blocks."""
        self._admit(data.draw(st.sampled_from(self.history), label="tokens"), data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Next prefill chunk, or a decode after appending a sampled token."""
        seq = data.draw(st.sampled_from(self.live), label="seq")
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(data.draw(st.integers(0, 2), label="token"))
        self._try_compute(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens), label="n"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live), label="parent")
        child = self._new_seq(parent.prompt_token_ids)
        child.token_ids = list(parent.token_ids)
        self.bm.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_mid_step(self, data: st.DataObject) -> None:
        """Slots granted (maybe with a pending copy), then freed before the forward ran."""
        seq = data.draw(st.sampled_from(self.live), label="seq")
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(0)
        self.bm.allocate_slots(seq, seq.num_uncomputed_tokens)
        self.live.remove(seq)
        self.bm.free(seq)
        self.kv.apply_copies(self.bm.take_copy_ops())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live), label="seq")
        self.live.remove(seq)
        self.bm.free(seq)
        self.history.append(list(seq.token_ids))

    @invariant()
    def every_block_in_exactly_one_state(self) -> None:
        bm = self.bm
        held = Counter(b for seq in self.live for b in seq.block_table)
        pool = bm.pool
        free, lru = list(pool._free), list(pool._lru)
        assert len(free) == len(set(free)), "double free"
        assert not set(free) & set(lru)
        for block in range(self.NUM_BLOCKS):
            assert pool.ref_count(block) == held[block], f"block {block} ref count"
            in_pool = (block in free) + (block in lru)
            assert in_pool == (0 if held[block] else 1), f"block {block} leaked or double-held"
            if block in free:
                assert pool._block_hash[block] is None
            if block in lru:
                assert pool._block_hash[block] is not None
        for block_hash, block in pool._cached.items():
            assert pool._block_hash[block] == block_hash
        assert sum(h is not None for h in pool._block_hash) == len(pool._cached)
        assert bm.num_free_blocks == len(free) + len(lru)
        assert bm.usage == 1.0 - bm.num_free_blocks / self.NUM_BLOCKS
        assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        for seq in self.live:
            blocks_needed = -(-seq.num_computed_tokens // self.BLOCK_SIZE)
            assert len(seq.block_table) == blocks_needed, "allocation beyond need"
            self.kv.check(seq, seq.num_computed_tokens)

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.NUM_BLOCKS
        assert self.bm.usage == 0.0
        pool = self.bm.pool
        assert all(pool.ref_count(block) == 0 for block in range(self.NUM_BLOCKS))
        assert len(pool._free) + len(pool._lru) == self.NUM_BLOCKS


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
