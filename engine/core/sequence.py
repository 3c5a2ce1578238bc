"""One generated choice: its tokens, its KV blocks and its progress through the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams
from engine.errors import EngineError
from engine.structured.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = "finished"


class Sequence:
    """A request's choice. ``n > 1`` requests own ``n`` sequences sharing the prompt's blocks."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        choice_index: int = 0,
        arrival_time: float | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.choice_index = choice_index
        self.params = params
        # Tokens that end the choice ("stop"): its own, and the model's end tokens unless ignored.
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        # Constrained decoding: where the output stands in the request's grammar. A preempted
        # sequence keeps it, as it keeps its output tokens (recompute only rebuilds the KV cache).
        self.matcher: GrammarMatcher | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
            f"status={self.status.value})"
        )


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """What one choice produced in one step (deltas, ready to stream)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"


@dataclass
class RequestOutput:
    """Per-step delta for one request; ``finished`` once every choice has finished."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    queue_time_s: float | None = None  # set on the first output: first scheduled - arrival
    # the request failed (its grammar allowed no token, say): its last output; the server answers
    # with the error (in-band once a stream has begun)
    error: EngineError | None = None
