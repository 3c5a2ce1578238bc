"""A simulated runner that drives the Scheduler exactly as EngineCore does (schedule -> copy blocks
-> forward -> sample -> update_from_output) and checks the step contract on every step. Its
"model" writes a fingerprint of each position's token prefix into a fake K/V pool and picks the
next token from the sequence's tokens, so every request's output can be checked against an
independent reference computed without any scheduling."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.blocks import BlockManager
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
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
        self.sched = Scheduler(self.config, self.bm, self.config.max_model_len)
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
        rows: list[Sequence] = []  # the forward's logits rows
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            self.kv.write(seq, num_new)
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                rows.append(seq)
        for seq in rows:  # the forward attends over the whole context of every sampled row
            self.kv.check(seq, seq.num_tokens)
        assert sorted(set(out.logits_rows)) == list(range(len(rows))), "every row is sampled"
        for seq, row in zip(out.to_sample, out.logits_rows, strict=True):
            source = rows[row]
            assert seq is source or (seq.request_id == source.request_id and seq not in rows)
        sampled = self.sample(out)
        update = self.sched.update_from_output(out, sampled)
        assert update.appended == sampled and not update.refused
        for seq in out.to_sample:
            assert seq.num_computed_tokens == seq.num_tokens - 1, "sampled before its context"
            assert (
                seq.is_finished or len(seq.block_table) * self.bm.block_size >= seq.num_tokens - 1
            )
        for seq in update.finished:
            assert seq.finish_reason == "length" and seq.block_table == []
            if all(s.is_finished for s in self.groups[seq.request_id]):
                self.finished_at[seq.request_id] = self.steps
        return out

    def sample(self, out: SchedulerOutput) -> list[SampledToken]:
        """The fake model's next token for every sequence the step samples."""
        return [
            SampledToken(seq, next_token(seq.token_ids, seq.choice_index), None, "", None)
            for seq in out.to_sample
        ]

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
        assert all(self.bm.pool.ref_count(b) == 0 for b in range(self.bm.num_blocks))
