"""Scheduler, n>1 choices: forked from the leader with copy-on-write, through preemption of
the leader and its siblings (a sibling already scheduled in the step included), ahead of later
prefills, and seated as a group under max_num_seqs; driven by tests/engine/simulated_engine.py."""

from __future__ import annotations

from engine.core.sequence import SequenceStatus
from tests.engine.simulated_engine import SimulatedEngine


def test_n_choices_fork_from_the_leader_and_copy_on_write() -> None:
    engine = SimulatedEngine(num_blocks=20, block_size=4, max_num_seqs=4)
    engine.add("multi", [5, 6, 7, 8, 9, 10], max_tokens=4, n=3)
    leader, *siblings = engine.groups["multi"]
    assert engine.sched.num_waiting == 3
    out = engine.sched.schedule()
    assert out.seqs == [leader] and out.num_new_tokens == [6]
    assert out.to_sample == [leader, *siblings] and out.logits_rows == [0, 0, 0]
    engine.kv.write(leader, 6)
    engine.sched.update_from_output(out, engine.sample(out))
    full, partial = leader.block_table
    for sib in siblings:
        assert sib.block_table == [full, partial] and sib.status is SequenceStatus.RUNNING
        assert sib.num_computed_tokens == 6 and sib.num_output_tokens == 1
    assert engine.bm.pool.ref_count(full) == engine.bm.pool.ref_count(partial) == 3

    out = engine.step()  # three decodes write into the shared partial block
    assert len(out.seqs) == 3
    assert len(out.copy_ops) == 2 and all(src == partial for src, _ in out.copy_ops)
    last_blocks = {seq.block_table[1] for seq in engine.groups["multi"]}
    assert len(last_blocks) == 3 and engine.bm.pool.ref_count(full) == 3
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
