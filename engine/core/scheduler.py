"""Iteration-level continuous batching: which sequences run how many tokens in the next step, and
what the step's sampled tokens do to them.

Policy, per step:
1. Running sequences that decode (one token left to compute), then running sequences whose
   prefill is in progress (chunked by the remaining token budget), in start order.
2. Only if nobody was preempted in this step: waiting sequences in FCFS order, each prefilling the
   chunk the budget allows, after attaching its cached prefix. Admission stops at the first one
   whose first chunk's blocks (or seat) cannot be had, so later small requests never overtake an
   earlier big one (no starvation; the head waits for running sequences to finish).
When a running sequence cannot get a block, the most recently started running sequence (possibly
itself) is preempted by recompute: its blocks are freed and it goes back to the front of the queue.

After the forward and the sampler, `update_from_output` is the one place a step's results change
the sequences (like vLLM v1's scheduler): it advances every scheduled sequence's progress
(committing full blocks, forking the n>1 siblings of a leader whose prefill completed), then gives
each sampled token to its sequence's grammar matcher, appends it and checks the stop conditions,
freeing a finished sequence's blocks at once. Stop strings are the one condition it cannot see:
they need the text, so the core detokenises each token before the update and hands over the stop
string the text completed (`SampledToken.stop_str`); the core emits what the update returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.blocks import BlockManager
from engine.core.sequence import Sequence, SequenceStatus, TokenLogprob
from engine.model.step_batch import StepBatch


@dataclass
class SchedulerOutput:
    """One step's work, in batch order: decodes first, then prefills."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copy_ops: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    # The sequences to sample after this step and the logits row each samples from: one row per
    # sequence whose chunk reaches its last token, in batch order; an n>1 leader's siblings, forked
    # by the update, sample from its row.
    to_sample: list[Sequence] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def to_step_batch(self) -> StepBatch:
        """The scheduled chunks of every sequence flattened into the runner's one row (before
        update_from_output advances their progress)."""
        batch = StepBatch([], [], [], [], [], [], copy_ops=self.copy_ops)
        for seq, num_new in zip(self.seqs, self.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + num_new
            batch.input_ids.extend(seq.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.query_lens.append(num_new)
            batch.seq_lens.append(end)
            batch.block_tables.append(seq.block_table)
            if end == seq.num_tokens:
                batch.sample_rows.append(len(batch.input_ids) - 1)
        return batch


@dataclass(slots=True)
class SampledToken:
    """One sequence's sampled token, as the core hands it to the update."""

    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None  # for the core's delta
    text: str  # the text it adds, detokenised by the core (for its delta)
    stop_str: str | None  # the stop string that text completed, which ends the sequence


@dataclass
class StepUpdate:
    """What a step's sampled tokens did, as update_from_output returns it to the core.

    A request whose grammar refused a token answers with that error alone: its sequences are all
    finished ("abort") and none of its tokens in this step is in `appended` or `finished`.
    """

    appended: list[SampledToken] = field(default_factory=list)  # in batch order
    finished: list[Sequence] = field(default_factory=list)  # finish_reason set, blocks freed
    refused: list[Sequence] = field(default_factory=list)  # the grammar refused its token


class Scheduler:
    """Continuous-batching scheduler over one BlockManager."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len  # the config's, capped by the model's positions
        self.block_manager = block_manager
        self.running: list[Sequence] = []  # in start order; the last is preempted first
        self.waiting: deque[Sequence] = deque()
        self._siblings: dict[int, list[Sequence]] = {}  # leader seq_id -> n>1 siblings to fork
        self._groups: dict[str, list[Sequence]] = {}  # request_id -> its sequences, until all end
        self._num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: queued, preempted, or n>1 siblings awaiting their fork."""
        return len(self.waiting) + sum(len(s) for s in self._siblings.values())

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, group: list[Sequence]) -> None:
        """Queue one request's sequences; group[0] prefills, the rest fork from it afterwards."""
        if not group or not group[0].token_ids:
            raise ValueError("a request needs at least one sequence and a non-empty prompt")
        request_id = group[0].request_id
        if request_id in self._groups:
            raise ValueError(f"request {request_id!r} is already scheduled")
        self._groups[request_id] = list(group)
        self.waiting.append(group[0])
        if len(group) > 1:
            self._siblings[group[0].seq_id] = list(group[1:])

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[Sequence, int] = {}  # seq -> new tokens, in scheduling order
        self._budget = self.max_num_batched_tokens
        num_preempted = 0

        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if len(scheduled) >= self.max_num_seqs or self._budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, self._budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, scheduled)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new
                self._budget -= num_new

        if num_preempted == 0:
            self._admit_waiting(scheduled)

        # Stable: decodes first, then prefills, each in scheduling order.
        order = sorted(scheduled, key=lambda s: s.num_uncomputed_tokens > 1)
        out = SchedulerOutput(
            seqs=order,
            num_new_tokens=[scheduled[s] for s in order],
            copy_ops=self.block_manager.take_copy_ops(),
            num_preempted=num_preempted,
        )
        row = 0
        for seq in order:
            if seq.num_computed_tokens + scheduled[seq] == seq.num_tokens:
                for choice in (seq, *self._siblings.get(seq.seq_id, ())):
                    out.to_sample.append(choice)
                    out.logits_rows.append(row)
                row += 1
        return out

    def _admit_waiting(self, scheduled: dict[Sequence, int]) -> None:
        seats = len(self.running) + sum(
            len(sibs) for leader_id, sibs in self._siblings.items() if self._is_running(leader_id)
        )
        now = time.monotonic()
        while self.waiting and self._budget > 0 and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            # An n>1 leader books seats for its siblings; a group larger than max_num_seqs
            # still runs when alone (its sequences then take turns within the cap).
            needed = 1 + len(self._siblings.get(seq.seq_id, ()))
            if seats + needed > self.max_num_seqs and seats > 0:
                break
            self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, self._budget)
            if not self.block_manager.allocate_slots(seq, num_new):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            scheduled[seq] = num_new
            self._budget -= num_new
            seats += needed

    def _is_running(self, seq_id: int) -> bool:
        return any(s.seq_id == seq_id for s in self.running)

    def _preempt(self, seq: Sequence, scheduled: dict[Sequence, int]) -> None:
        """Recompute later: free seq's blocks and put it at the front of the queue."""
        self.running.remove(seq)
        if seq in scheduled:  # give back what it was granted earlier in this step
            self._budget += scheduled.pop(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, step: SchedulerOutput, sampled: list[SampledToken]) -> StepUpdate:
        """Apply a step's results: progress, then each sampled token (``sampled`` follows
        ``step.to_sample``)."""
        self._advance(step)
        update = StepUpdate()
        for sample in sampled:
            seq = sample.seq
            if seq.is_finished:  # a sibling's refused token ended its request earlier in this loop
                continue
            if seq.matcher is not None and not seq.matcher.accept(sample.token_id):
                # The sampler picks only allowed tokens, so the grammar allowed none here, or the
                # library gave up on it: the request ends, without the token.
                update.refused.append(seq)
                self.abort(seq.request_id)
                continue
            seq.append_token(sample.token_id)
            update.appended.append(sample)
            reason = self._stop_reason(seq, sample)
            if reason is not None:
                self._finish(seq, reason)
                update.finished.append(seq)
        if update.refused:
            ended = {seq.request_id for seq in update.refused}
            update.appended = [s for s in update.appended if s.seq.request_id not in ended]
            update.finished = [s for s in update.finished if s.request_id not in ended]
        return update

    def _advance(self, step: SchedulerOutput) -> None:
        """Count the step's chunks as computed; fork the siblings of a leader now prefilled."""
        block_size = self.block_manager.block_size
        for seq, num_new in zip(step.seqs, step.num_new_tokens, strict=True):
            computed = seq.num_computed_tokens
            seq.num_computed_tokens = computed + num_new
            # Earlier full blocks were committed when they filled (or matched on admission).
            if (computed + num_new) // block_size > computed // block_size:
                self.block_manager.commit_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                for sibling in self._siblings.pop(seq.seq_id, ()):
                    self._fork(seq, sibling)

    def _stop_reason(self, seq: Sequence, sample: SampledToken) -> str | None:
        """Why seq ends with the token it just appended, if it does."""
        if (
            sample.stop_str is not None
            or sample.token_id in seq.stop_token_ids
            or (seq.matcher is not None and seq.matcher.is_terminated)
        ):
            return "stop"
        max_tokens = seq.params.max_tokens
        if (
            max_tokens is not None and seq.num_output_tokens >= max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fork(self, leader: Sequence, sibling: Sequence) -> None:
        self.block_manager.fork(leader, sibling)
        sibling.num_computed_tokens = leader.num_computed_tokens
        sibling.num_cached_tokens = leader.num_cached_tokens
        sibling.first_scheduled_time = leader.first_scheduled_time
        sibling.status = SequenceStatus.RUNNING
        self.running.append(sibling)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        group = self._groups.get(seq.request_id)
        if group is not None and all(s.is_finished for s in group):
            del self._groups[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request with reason "abort", freeing blocks."""
        group = self._groups.pop(request_id, [])
        aborted = [s for s in group if not s.is_finished]
        for seq in aborted:
            self._siblings.pop(seq.seq_id, None)  # a leader's siblings not forked yet
            self._finish(seq, "abort")
        return aborted
