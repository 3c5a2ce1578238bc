"""Scheduler.update_from_output, a step's results applied: progress, appends, the stop conditions
(max_tokens, max_model_len, stop tokens, stop strings, a completed grammar), a refused token ending
its request, n>1 siblings forked on their leader's row, and preemption keeping the output so far.
The sampled tokens are made up here, as the core would hand them over (engine_core.py)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.blocks import BlockManager
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput, StepUpdate
from engine.core.sequence import Sequence, SequenceStatus

EOS = 2
NUM_BLOCKS = 20


class FakeMatcher:
    """A grammar that takes tokens until it refuses one, or is complete after `terminate_after`."""

    def __init__(self, refuse: int | None = None, terminate_after: int | None = None) -> None:
        self.refuse = refuse
        self.terminate_after = terminate_after
        self.accepted: list[int] = []

    def accept(self, token: int) -> bool:
        if token == self.refuse:
            return False
        self.accepted.append(token)
        return True

    @property
    def is_terminated(self) -> bool:
        return self.terminate_after is not None and len(self.accepted) >= self.terminate_after


class Harness:
    """A scheduler over a real block manager, stepped with made-up sampled tokens."""

    def __init__(self, max_model_len: int = 2048, num_blocks: int = NUM_BLOCKS) -> None:
        config = EngineConfig(model="fake", max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
        self.bm = BlockManager(num_blocks, config.block_size, enable_prefix_caching=True)
        self.sched = Scheduler(config, self.bm, max_model_len)
        self._next_id = 0

    def add(self, request_id: str, prompt: list[int], n: int = 1, **params: Any) -> list[Sequence]:
        sampling = SamplingParams(n=n, **params)
        group = []
        for index in range(n):
            seq = Sequence(
                self._next_id, request_id, prompt, sampling, index, None, frozenset({EOS})
            )
            group.append(seq)
            self._next_id += 1
        self.sched.add(group)
        return group

    def step(
        self, token: int = 7, stop_str: dict[Sequence, str] | None = None
    ) -> tuple[SchedulerOutput, StepUpdate]:
        """One step in which every sampled sequence draws `token` + its choice index (and the
        text of those in `stop_str` completes that stop string)."""
        out = self.sched.schedule()
        sampled = [
            SampledToken(seq, token + seq.choice_index, None, "", (stop_str or {}).get(seq))
            for seq in out.to_sample
        ]
        return out, self.sched.update_from_output(out, sampled)

    def assert_all_free(self) -> None:
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.sched.has_unfinished()


# ------------------------------------------------------------------------ progress, length
def test_max_tokens_ends_with_length_and_frees_the_blocks_at_once() -> None:
    h = Harness()
    (seq,) = h.add("r", [1, 2, 3, 4, 5], max_tokens=3)
    for _ in range(2):
        _, update = h.step()
        assert [s.seq for s in update.appended] == [seq] and update.finished == []
    _, update = h.step()
    assert update.finished == [seq] and seq.finish_reason == "length"
    assert seq.output_token_ids == [7, 7, 7] and seq.block_table == []
    h.assert_all_free()


def test_max_model_len_ends_a_request_without_max_tokens() -> None:
    h = Harness(max_model_len=8)
    (seq,) = h.add("r", [1] * 6, max_tokens=None)
    h.step()
    _, update = h.step()
    assert update.finished == [seq] and seq.finish_reason == "length" and seq.num_tokens == 8


def test_a_prefill_chunk_advances_progress_without_a_sample() -> None:
    h = Harness()
    (seq,) = h.add("r", list(range(70)), max_tokens=2)  # 64-token budget: two chunks
    out, update = h.step()
    assert out.to_sample == [] and update == StepUpdate()
    assert seq.num_computed_tokens == 64 and seq.num_output_tokens == 0
    out, update = h.step()
    assert out.to_sample == [seq] and seq.num_computed_tokens == 70 and seq.num_output_tokens == 1


# ------------------------------------------------------------------------------ stops
@pytest.mark.parametrize(
    ("params", "token", "reason"),
    [
        ({}, EOS, "stop"),
        ({"ignore_eos": True}, EOS, None),
        ({"stop_token_ids": [9]}, 9, "stop"),
        ({"ignore_eos": True, "stop_token_ids": [9]}, 9, "stop"),
        ({"stop_token_ids": [9]}, 7, None),
    ],
)
def test_stop_tokens(params: dict, token: int, reason: str | None) -> None:
    h = Harness()
    (seq,) = h.add("r", [1, 2, 3], max_tokens=10, **params)
    _, update = h.step(token)
    assert seq.output_token_ids == [token] and seq.finish_reason == reason
    assert update.finished == ([seq] if reason else [])


def test_a_stop_string_ends_the_sequence_and_wins_over_length() -> None:
    h = Harness()
    (long,) = h.add("long", [1, 2, 3], max_tokens=10, stop=["END"])
    (last,) = h.add("last", [4, 5, 6], max_tokens=2, stop=["END"])
    h.step()
    _, update = h.step(stop_str={long: "END", last: "END"})
    assert update.finished == [long, last]
    assert long.finish_reason == last.finish_reason == "stop"
    h.assert_all_free()


# ---------------------------------------------------------------------------- grammars
def test_a_completed_grammar_ends_with_stop() -> None:
    h = Harness()
    (seq,) = h.add("r", [1, 2, 3], max_tokens=10)
    matcher = seq.matcher = FakeMatcher(terminate_after=2)
    h.step()
    _, update = h.step()
    assert update.finished == [seq] and seq.finish_reason == "stop"
    assert matcher.accepted == [7, 7]


def test_a_refused_token_ends_its_whole_request_and_only_it() -> None:
    h = Harness()
    group = h.add("constrained", [1, 2, 3], n=3, max_tokens=10)
    (other,) = h.add("other", [4, 5, 6], max_tokens=10)
    matchers = [FakeMatcher(refuse=8) for _ in group]  # choice 1 draws 7 + 1 = 8
    for seq, matcher in zip(group, matchers, strict=True):
        seq.matcher = matcher
    out, update = h.step()
    assert out.to_sample == [*group, other] and out.logits_rows == [0, 0, 0, 1]
    assert update.refused == [group[1]]
    assert [s.seq for s in update.appended] == [other] and update.finished == []
    assert all(s.finish_reason == "abort" and s.block_table == [] for s in group)
    assert matchers[0].accepted == [7], "the leader's token came before the refusal"
    assert matchers[2].accepted == [], "a sibling after the refusal is not given its token"
    assert other.status is SequenceStatus.RUNNING and other.output_token_ids == [7]
    h.sched.abort("other")
    h.assert_all_free()


# -------------------------------------------------------------------------- n > 1, preemption
def test_siblings_fork_on_their_leaders_row_and_finish_on_their_own() -> None:
    h = Harness()
    leader, first, second = h.add("n3", [1, 2, 3, 4, 5, 6], n=3, max_tokens=3, stop=["x"])
    out, update = h.step()
    assert out.seqs == [leader] and out.to_sample == [leader, first, second]
    assert out.logits_rows == [0, 0, 0]
    assert [s.seq for s in update.appended] == [leader, first, second]
    assert [s.output_token_ids for s in (leader, first, second)] == [[7], [8], [9]]
    assert first.block_table == leader.block_table and first.num_computed_tokens == 6
    _, update = h.step(stop_str={first: "x"})
    assert update.finished == [first] and first.finish_reason == "stop"
    assert leader.status is second.status is SequenceStatus.RUNNING
    _, update = h.step()
    assert update.finished == [leader, second]
    assert leader.finish_reason == second.finish_reason == "length"
    h.assert_all_free()


def test_a_preempted_sequence_keeps_its_output_and_resumes_it() -> None:
    h = Harness(num_blocks=3)
    (a,) = h.add("a", [1] * 4, max_tokens=8)  # grows to 12 tokens: 3 blocks
    (b,) = h.add("b", [2] * 3, max_tokens=4)  # grows to 7 tokens: 2 blocks
    h.step()
    h.step()
    out, update = h.step()  # b needs a second block: none is left, so it preempts itself
    assert out.num_preempted == 1 and b.status is SequenceStatus.WAITING
    assert out.to_sample == [a] and [s.seq for s in update.appended] == [a]
    assert b.output_token_ids == [7, 7] and b.num_computed_tokens == 0
    for _ in range(30):
        h.step()
    assert a.finish_reason == "length" and a.output_token_ids == [7] * 8
    assert b.finish_reason == "length" and b.output_token_ids == [7] * 4
    assert b.num_preemptions == 1
    h.assert_all_free()
