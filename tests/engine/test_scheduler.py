"""Scheduler: caps, decode priority, chunked prefill, preemption, abort, FCFS, n>1 forks.

A simulated runner drives the scheduler exactly as EngineCore does (schedule -> copy blocks ->
forward -> finish_step -> sample -> finish). Its "model" writes a fingerprint of each position's
token prefix into a fake K/V pool and picks the next token from the sequence's tokens, so every
request's output can be checked against an independent reference computed without any scheduling.
"""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.core.blocks import BlockManager
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from tests.engine.test_blocks import FakeKVCache

VOCAB = 50


def next_token(tokens: list[int], choice_index: int) -> int:
    """The fake model: deterministic in the context, different per n>1 choice."""
    return hash((choice_index, tuple(tokens))) % VOCAB


def reference_output(prompt: list[int], max_tokens: int, choice_index: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, choice_index))
    return tokens[len(prompt) :]


class SimulatedEngine:
    """Drives a Scheduler like EngineCore and checks the step contract on every step."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = EngineConfig(
            model="fake",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
        )
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.config, self.bm)
        self.kv = FakeKVCache(num_blocks, block_size)
        self.groups: dict[str, list[Sequence]] = {}
        self.finished_at: dict[str, int] = {}
        self.added_at: dict[str, int] = {}
        self.steps = 0
        self._next_seq_id = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, n: int = 1) -> None:
        params = SamplingParams(n=n, max_tokens=max_tokens)
        group = []
        for index in range(n):
            group.append(Sequence(self._next_seq_id, request_id, prompt, params, index))
            self._next_seq_id += 1
        self.groups[request_id] = group
        self.added_at[request_id] = self.steps
        self.sched.add(group)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        self._check_schedule(out)
        self.kv.apply_copies(out.copy_ops)
        rows: list[Sequence] = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            self.kv.write(seq, num_new)
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                rows.append(seq)
        for seq in rows:  # the forward attends over the whole context of every sampled row
            self.kv.check(seq, seq.num_tokens)
        to_sample = self.sched.finish_step(out)
        assert {row for _, row in to_sample} == set(range(len(rows))), "every row is sampled"
        for seq, row in to_sample:
            source = rows[row]
            assert seq is source or (seq.request_id == source.request_id and seq.block_table)
            assert seq.num_computed_tokens == seq.num_tokens, "sampled before its context is in"
            seq.append_token(next_token(seq.token_ids, seq.choice_index))
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
                if all(s.is_finished for s in self.groups[seq.request_id]):
                    self.finished_at[seq.request_id] = self.steps
        return out

    def _check_schedule(self, out: SchedulerOutput) -> None:
        cfg = self.config
        assert len(out.seqs) == len(out.num_new_tokens) == len(set(out.seqs))
        assert len(out.seqs) <= cfg.max_num_seqs
        assert sum(out.num_new_tokens) <= cfg.max_num_batched_tokens
        is_prefill = [seq.num_uncomputed_tokens > 1 for seq in out.seqs]
        assert is_prefill == sorted(is_prefill), "decodes must come before prefills"
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= num_new <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + num_new
        assert out.is_empty == (not out.seqs)

    def run(self, max_steps: int) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "did not finish in time"
            self.step()

    def assert_outputs_match_reference(self) -> None:
        for group in self.groups.values():
            for seq in group:
                if seq.finish_reason == "abort":
                    continue
                assert seq.finish_reason == "length"
                expected = reference_output(
                    seq.prompt_token_ids, seq.params.max_tokens, seq.choice_index
                )
                assert seq.output_token_ids == expected, f"{seq} output differs"

    def assert_all_blocks_returned(self) -> None:
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.usage == 0.0
        assert not any(self.bm._ref)


def test_caps_hold_every_step_over_a_long_random_run() -> None:
    rng = random.Random(1234)
    engine = SimulatedEngine(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    shared_prefix = [rng.randrange(VOCAB) for _ in range(12)]
    aborted = set()
    for i in range(400):
        if i < 300 and rng.random() < 0.4:
            prompt_len = rng.randint(1, 60)
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            if rng.random() < 0.3:
                prompt = shared_prefix + prompt
            engine.add(f"req{i}", prompt, max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2, 3]))
        if rng.random() < 0.03 and engine.groups:
            victim = rng.choice(sorted(engine.groups))
            if engine.sched.abort(victim):
                aborted.add(victim)
        engine.step()
        assert engine.sched.num_running <= engine.config.max_num_seqs
    engine.run(max_steps=3000)
    assert engine.sched.num_preemptions > 0, "the run should exercise preemption"
    assert engine.bm.prefix_cache_hits > 0, "the run should exercise prefix hits"
    assert aborted, "the run should exercise aborts"
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_decodes_are_scheduled_before_a_running_chunked_prefill() -> None:
    engine = SimulatedEngine(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add("short", [1, 2, 3], max_tokens=5)
    engine.add("long", list(range(30)), max_tokens=2)
    out = engine.step()
    assert out.num_new_tokens == [3, 5]  # both prefills: short fully, long's first chunk
    for _ in range(3):
        out = engine.step()
        assert [s.request_id for s in out.seqs] == ["short", "long"]
        assert out.num_new_tokens == [1, 7]  # the decode first, the chunk gets the rest
    engine.run(max_steps=50)
    engine.assert_outputs_match_reference()


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    engine = SimulatedEngine(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add("long", list(range(50)), max_tokens=3)
    (seq,) = engine.groups["long"]
    chunks = []
    while seq.num_output_tokens == 0:
        out = engine.step()
        chunks.append(out.num_new_tokens[0])
    assert chunks == [16, 16, 16, 2]
    assert len(seq.block_table) == 13  # 51 tokens in blocks of 4: allocated as it grew
    engine.run(max_steps=20)
    engine.assert_outputs_match_reference()


def test_prefill_chunks_share_the_budget_with_later_waiting_requests() -> None:
    engine = SimulatedEngine(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=10)
    engine.add("a", list(range(6)), max_tokens=2)
    engine.add("b", list(range(20, 40)), max_tokens=2)
    out = engine.step()
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [6, 4]


def test_preemption_when_blocks_run_out_then_resume_to_completion() -> None:
    # 8 blocks of 4 tokens; each request grows to 8 + 12 = 20 tokens (5 blocks).
    engine = SimulatedEngine(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
    for name in ("a", "b", "c"):
        engine.add(name, [ord(name)] * 8, max_tokens=12)
    first_preempted = None
    while engine.sched.has_unfinished():
        out = engine.step()
        if out.num_preempted and first_preempted is None:
            first_preempted = [s for g in engine.groups.values() for s in g if s.num_preemptions]
        assert engine.steps < 200
    assert first_preempted is not None and engine.sched.num_preemptions >= 1
    assert [s.request_id for s in first_preempted] == ["c"], "the latest started goes first"
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_sequence_preempts_itself_when_it_is_the_latest() -> None:
    engine = SimulatedEngine(num_blocks=3, max_num_seqs=4, max_num_batched_tokens=64)
    engine.add("a", [1] * 4, max_tokens=8)  # grows to 12 tokens: 3 blocks
    engine.add("b", [2] * 3, max_tokens=4)  # grows to 7 tokens: 2 blocks
    engine.step()  # a gets 1 block, b gets 1 block
    a, b = engine.groups["a"][0], engine.groups["b"][0]
    engine.step()  # a takes the last free block, b's 4th token still fits in its block
    engine.add("c", [3] * 3, max_tokens=2)  # queued: no block left for it
    out = engine.step()  # b needs a 2nd block: none free; b is the latest, so b preempts itself
    assert out.num_preempted == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and list(engine.sched.waiting) == [b, engine.groups["c"][0]]
    assert [s.request_id for s in out.seqs] == ["a"]
    engine.run(max_steps=100)
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_recompute_after_preemption_uses_the_prefix_cache() -> None:
    engine = SimulatedEngine(num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64)
    engine.add("a", [1] * 4, max_tokens=4)  # 1 block, 2 when it writes position 4
    engine.add("b", [2] * 14, max_tokens=3)  # 3 full blocks + 1 partial: the pool is full
    engine.step()
    a, b = engine.groups["a"][0], engine.groups["b"][0]
    queries, hits = engine.bm.prefix_cache_queries, engine.bm.prefix_cache_hits
    out = engine.step()  # a needs a block: b (latest) is preempted, a takes b's partial block
    assert out.num_preempted == 1 and b.num_preemptions == 1
    tokens_to_recompute = b.num_tokens
    while b.status is not SequenceStatus.RUNNING:  # b fits again once a finishes
        engine.step()
    assert a.is_finished
    # b's three full blocks stayed cached and are reused; retries that failed did not count.
    assert engine.bm.prefix_cache_hits - hits == 12
    assert engine.bm.prefix_cache_queries - queries == tokens_to_recompute
    engine.run(max_steps=100)
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_abort_frees_blocks_in_the_same_step() -> None:
    engine = SimulatedEngine(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add("decoding", [1] * 5, max_tokens=50)
    engine.add("prefilling", list(range(30)), max_tokens=5)
    engine.add("forking", [3] * 5, max_tokens=5, n=3)  # leader still waiting, siblings attached
    engine.step()
    engine.step()
    assert engine.bm.num_free_blocks < 20
    assert engine.sched.num_waiting == 3
    for name in ("decoding", "prefilling", "forking"):
        aborted = engine.sched.abort(name)
        assert {s.seq_id for s in aborted} == {s.seq_id for s in engine.groups[name]}
        assert all(s.finish_reason == "abort" and s.block_table == [] for s in aborted)
    engine.assert_all_blocks_returned()
    assert not engine.sched.has_unfinished() and engine.sched.num_waiting == 0
    assert engine.sched.schedule().is_empty
    assert engine.sched.abort("decoding") == []


def test_waiting_requests_do_not_overtake_a_head_of_line_request_that_does_not_fit() -> None:
    engine = SimulatedEngine(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    engine.add("running", [1] * 20, max_tokens=10)  # 5 blocks now, 8 at the end
    engine.step()
    engine.add("big", [2] * 30, max_tokens=2)  # first chunk needs 8 blocks; 6 are free
    engine.add("small", [3] * 2, max_tokens=2)  # would fit, but must not jump the queue
    out = engine.step()
    assert [s.request_id for s in out.seqs] == ["running"]
    engine.run(max_steps=100)
    assert engine.finished_at["big"] <= engine.finished_at["small"]
    engine.assert_outputs_match_reference()


def test_no_starvation_under_continuous_arrivals() -> None:
    """A big request keeps its place while small ones keep arriving: everything finishes in bound.

    Calibrated: with this load, FCFS finishes every request within ~25 steps of its arrival, while
    a policy that lets later requests that fit overtake a big one that does not keeps big
    requests waiting for 60 to 135 steps.
    """
    rng = random.Random(7)
    engine = SimulatedEngine(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128)
    for i in range(400):
        if i % 50 == 5:  # its 100-token prompt needs 25 of the 40 blocks in one chunk
            engine.add(f"big{i}", [rng.randrange(VOCAB) for _ in range(100)], max_tokens=8)
        if rng.random() < 0.5:
            engine.add(f"small{i}", [rng.randrange(VOCAB) for _ in range(10)], max_tokens=12)
        engine.step()
    engine.run(max_steps=1000)
    waits = {rid: engine.finished_at[rid] - engine.added_at[rid] for rid in engine.groups}
    assert max(waits.values()) <= 45, sorted(waits.items(), key=lambda kv: -kv[1])[:5]
    assert engine.sched.num_preemptions > 0
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_n_choices_fork_from_the_leader_and_copy_on_write() -> None:
    engine = SimulatedEngine(num_blocks=20, block_size=4, max_num_seqs=4)
    engine.add("multi", [5, 6, 7, 8, 9, 10], max_tokens=4, n=3)
    leader, *siblings = engine.groups["multi"]
    assert engine.sched.num_waiting == 3
    out = engine.sched.schedule()
    assert out.seqs == [leader] and out.num_new_tokens == [6]
    engine.kv.write(leader, 6)
    to_sample = engine.sched.finish_step(out)
    assert [(s.choice_index, row) for s, row in to_sample] == [(0, 0), (1, 0), (2, 0)]
    full, partial = leader.block_table
    for sib in siblings:
        assert sib.block_table == [full, partial] and sib.status is SequenceStatus.RUNNING
        assert sib.num_computed_tokens == 6 and sib.token_ids == leader.token_ids
    assert engine.bm._ref[full] == engine.bm._ref[partial] == 3
    for seq, _ in to_sample:
        seq.append_token(next_token(seq.token_ids, seq.choice_index))

    out = engine.step()  # three decodes write into the shared partial block
    assert len(out.seqs) == 3
    assert len(out.copy_ops) == 2 and all(src == partial for src, _ in out.copy_ops)
    last_blocks = {seq.block_table[1] for seq in engine.groups["multi"]}
    assert len(last_blocks) == 3 and engine.bm._ref[full] == 3
    engine.run(max_steps=20)
    outputs = [seq.output_token_ids for seq in engine.groups["multi"]]
    assert len({tuple(o) for o in outputs}) == 3, "choices should differ"
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_n_choices_survive_preemption_of_leader_and_siblings() -> None:
    # 9 blocks of 4: the group's 3 choices grow to 3 x 6 blocks, far beyond the pool.
    engine = SimulatedEngine(num_blocks=9, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    engine.add("multi", list(range(10)), max_tokens=12, n=3)
    engine.run(max_steps=300)
    assert engine.sched.num_preemptions > 0
    assert any(s.num_preemptions for s in engine.groups["multi"][1:])
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_siblings_wait_while_their_leader_is_preempted_mid_prefill() -> None:
    # "first" alone grows to fill the pool (14 tokens in 7 blocks of 2) while the n=2 leader
    # prefills its 12-token prompt in chunks of at most 4 tokens.
    engine = SimulatedEngine(num_blocks=7, block_size=2, max_num_seqs=4, max_num_batched_tokens=4)
    engine.add("first", [1, 1], max_tokens=12)
    engine.add("multi", list(range(12)), max_tokens=2, n=2)
    leader, sibling = engine.groups["multi"]
    while not leader.num_preemptions:
        engine.step()
        assert engine.steps < 20
    assert leader.num_output_tokens == 0, "preempted before its prefill completed"
    assert leader.status is SequenceStatus.WAITING and leader.num_computed_tokens == 0
    assert sibling.status is SequenceStatus.WAITING and sibling.block_table == []
    assert engine.sched.num_waiting == 2
    engine.run(max_steps=100)
    assert sibling.num_preemptions == 1, "the forked sibling was preempted and recomputed alone"
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_forked_siblings_decode_before_a_prefill_started_after_their_leader() -> None:
    engine = SimulatedEngine(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=10)
    engine.add("multi", [1, 2, 3, 4], max_tokens=5, n=2)
    engine.add("long", list(range(30)), max_tokens=2)
    out = engine.step()
    assert out.num_new_tokens == [4, 6]
    leader, sibling = engine.groups["multi"]
    (long,) = engine.groups["long"]
    assert engine.sched.running == [leader, long, sibling]  # sibling forked after long started
    out = engine.step()
    assert out.seqs == [leader, sibling, long] and out.num_new_tokens == [1, 1, 8]


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch() -> None:
    engine = SimulatedEngine(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=10)
    engine.add("multi", [1, 2, 3, 4], max_tokens=5, n=2)  # 1 full block, shared after the fork
    engine.add("long", list(range(14)), max_tokens=2)  # 4 blocks at the end
    engine.step()  # leader 4 tokens (1 block), long 6 tokens (2 blocks)
    leader, sibling = engine.groups["multi"]
    (long,) = engine.groups["long"]
    # Both decodes take a new block (5 used); long's chunk needs 2 more: the sibling, started
    # last, is preempted although it was already scheduled in this step.
    out = engine.step()
    assert out.num_preempted == 1 and sibling.num_preemptions == 1
    assert out.seqs == [leader, long] and out.num_new_tokens == [1, 8]
    assert engine.bm.num_free_blocks == 0
    engine.run(max_steps=100)
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_finishing_a_leader_before_its_fork_hands_the_group_to_a_sibling() -> None:
    engine = SimulatedEngine(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=64)
    engine.add("multi", [1, 2, 3], max_tokens=3, n=3)
    leader, second, third = engine.groups["multi"]
    engine.sched.finish(leader, "abort")
    assert list(engine.sched.waiting) == [second] and engine.sched.num_waiting == 2
    engine.run(max_steps=20)
    assert second.finish_reason == third.finish_reason == "length"
    engine.assert_outputs_match_reference()
    engine.assert_all_blocks_returned()


def test_group_of_n_books_seats_under_max_num_seqs() -> None:
    engine = SimulatedEngine(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    engine.add("single", [1, 2], max_tokens=10)
    engine.add("multi", [3, 4], max_tokens=3, n=3)  # needs 3 seats after the fork
    engine.add("late", [5, 6], max_tokens=3)
    for _ in range(12):
        engine.step()
        assert engine.sched.num_running <= 4
    engine.run(max_steps=50)
    engine.assert_outputs_match_reference()
