"""Scheduler: caps, decode priority, chunked prefill, preemption, abort, FCFS.

Each test drives the scheduler through tests/engine/simulated_engine.py, which checks the step
contract on every step and every output against a reference computed without any scheduling.
n>1 forks: test_scheduler_forks.py.
"""

from __future__ import annotations

import random

from engine.core.sequence import SequenceStatus
from tests.engine.simulated_engine import VOCAB, SimulatedEngine


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
