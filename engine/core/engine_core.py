"""The engine loop: admit requests, run one scheduled step at a time, emit per-step deltas.

One step = schedule -> run the model -> sample -> detokenize -> the scheduler's update (appends,
stop conditions, frees; engine/core/scheduler.py) -> RequestOutput deltas from what it returns.
Detokenising comes before the update because a stop string, found in the text, ends a sequence
there; the text a sequence held back is flushed when the update says it finished otherwise. The
core is synchronous and single-threaded; the server drives it from its own thread.

A constrained request (SamplingParams.structured) holds a ticket on its grammar for as long as
it lives and enters the scheduler once the grammar has compiled (engine.structured, in a worker
process; the server awaits that compile at admission, so it is usually cached by then); each of
its sequences gets a matcher, which the sampler masks with and which takes every token the
sequence appends (in the update). A grammar that terminates finishes its sequence with "stop";
one that refuses the sampled token (it allows none, or the library gave up on its size) ends the
request with a 400 in its output (RequestOutput.error), and the token is not emitted: a reply
never breaks its constraint.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch

from engine import startup
from engine.config import EngineConfig
from engine.core.blocks import BlockManager
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.sampling import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput, StepUpdate
from engine.core.sequence import (
    CompletionOutput,
    RequestOutput,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)
from engine.errors import EngineBusyError, EngineError, EngineSleepingError, InvalidRequestError
from engine.model.footprint import MemoryFootprint
from engine.model.host_memory import trim_heap
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.step_profile import BATCH, FORWARD, POSTPROCESS, SAMPLE, SCHEDULE
from engine.structured.compiler import (
    CompilerStats,
    CompileSettings,
    GrammarCompiler,
    GrammarTicket,
)
from engine.structured.matcher import GrammarMatcher

log = logging.getLogger("engine.core")

# How long a step with nothing to schedule but compiles under way waits for one to finish (the
# loop then takes new commands), rather than spinning on a core the compile needs.
GRAMMAR_WAIT_S = 0.01


@dataclass
class EngineStats:
    """Gauges (now) and cumulative counters, as the metrics endpoint exports them."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_blocks: int
    block_size: int
    # requests a grammar ended mid-output, by error code (grammar_dead_end, grammar_too_complex)
    grammar_failures: dict[str, int] = field(default_factory=dict)


@dataclass
class _Request:
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    grammar: GrammarTicket | None = None  # held until the request ends
    started: bool = False  # first output sent
    pending: dict[int, CompletionOutput] = field(default_factory=dict)  # this step's deltas


class EngineCore:
    """Step-level engine: add_request / step / abort, driven by the server or the offline API."""

    @classmethod
    def for_serving(cls, config: EngineConfig) -> EngineCore:
        """The core of an engine process: loaded with the cyclic collector paused and what it
        built frozen out of later passes (engine.startup.collector_paused), then the heap that
        collection freed given back to the OS."""
        with startup.collector_paused():
            core = cls(config)
        trim_heap()
        return core

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config)
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        model_limit = loaded.max_position_embeddings
        self.max_model_len = min(config.max_model_len, model_limit or config.max_model_len)
        self.max_n = config.max_n
        self.runner = ModelRunner(config, loaded, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.sampler = Sampler()
        with startup.phase("structured outputs"):
            self.grammars = GrammarCompiler(
                loaded.tokenizer, self.vocab_size, self.eos_token_ids, CompileSettings.of(config)
            )
        self._compiling: set[str] = set()  # requests whose grammar is still compiling
        self._grammar_failures: Counter[str] = Counter()
        # where a step's time goes, off until a benchmark turns it on (engine.model.step_profile)
        self.profile = self.runner.profile
        self._requests: dict[str, _Request] = {}
        self._next_seq_id = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # ------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; InvalidRequestError if it can never run, EngineSleepingError while
        asleep."""
        if self.runner.sleeping:
            raise EngineSleepingError()
        self._validate(request_id, prompt_token_ids, params)
        grammar = None
        if params.structured is not None:
            grammar = self.grammars.request(params.structured)
            if grammar.future.done() and grammar.future.exception() is not None:
                grammar.release()
                raise grammar.future.exception()  # a constraint that failed refuses it now
        seqs = []
        for index in range(params.n):
            seqs.append(
                Sequence(
                    self._next_seq_id,
                    request_id,
                    prompt_token_ids,
                    params,
                    choice_index=index,
                    arrival_time=arrival_time,
                    eos_token_ids=self.eos_token_ids,
                )
            )
            self._next_seq_id += 1
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) for _ in seqs
        ]
        request = self._requests[request_id] = _Request(seqs, detokenizers, grammar)
        if grammar is None or grammar.future.done():
            self._schedule(request)
        else:
            self._compiling.add(request_id)

    def _schedule(self, request: _Request) -> None:
        if request.grammar is not None:
            compiled = request.grammar.future.result()
            for seq in request.seqs:
                seq.matcher = compiled.matcher()
        self.scheduler.add(request.seqs)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar has compiled go to the scheduler; those whose compile failed
        end with its error (the server compiles at admission, so only direct callers see
        this)."""
        outputs = []
        for request_id in list(self._compiling):
            request = self._requests[request_id]
            assert request.grammar is not None
            future = request.grammar.future
            if not future.done():
                continue
            self._compiling.discard(request_id)
            error = future.exception()
            if error is None:
                self._schedule(request)
                continue
            log.warning("request %s: its constraint did not compile: %s", request_id, error)
            assert isinstance(error, EngineError)
            outputs.append(self._fail(request_id, request, error))
        return outputs

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = next(
            (t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad!r} is out of the vocabulary [0, {self.vocab_size})", param="prompt"
            )
        params.validate()
        if params.n > self.max_n:
            raise InvalidRequestError(f"n must be at most {self.max_n}", param="n")
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if len(prompt) + max_tokens > self.max_model_len:
            if params.max_tokens is None:
                detail = f"{len(prompt)} prompt tokens leave no room for a completion"
            else:
                detail = (
                    f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                    f"prompt, {max_tokens} for the completion)"
                )
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; {detail}. "
                "Please reduce the length of the prompt or max_tokens.",
                param="max_tokens" if params.max_tokens is not None else "prompt",
            )

    def abort(self, request_id: str) -> None:
        """Drop a request now (its blocks are freed at once); unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._compiling.discard(request_id)
            self.scheduler.abort(request_id)
            if request.grammar is not None:
                request.grammar.release()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the deltas of every request that made progress."""
        laps = self.profile.laps()  # books the spans while profiling is on, else nothing
        compiled = self._admit_compiled() if self._compiling else []
        out = self.scheduler.schedule()
        if out.is_empty:
            if self._compiling and not compiled:
                futures = [self._requests[r].grammar.future for r in self._compiling]  # type: ignore[union-attr]
                wait(futures, GRAMMAR_WAIT_S, FIRST_COMPLETED)
            return compiled
        laps.lap(SCHEDULE)
        batch = out.to_step_batch()
        laps.lap(BATCH)
        logits = self.runner.execute(batch)
        laps.lap(FORWARD)
        token_ids, logprobs = self._sample(out, logits) if out.to_sample else ([], [])
        laps.lap(SAMPLE)
        sampled = [
            self._with_text(seq, token, logprob)
            for seq, token, logprob in zip(out.to_sample, token_ids, logprobs, strict=True)
        ]
        update = self.scheduler.update_from_output(out, sampled)
        outputs = compiled + self._outputs(update)
        laps.lap(POSTPROCESS)
        laps.end_step()
        return outputs

    def _sample(
        self, out: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        rows = out.logits_rows
        if rows != list(range(logits.shape[0])):  # n>1 siblings share their leader's row
            logits = logits[torch.tensor(rows, device=logits.device)]
        return self.sampler(logits, out.to_sample)

    def _with_text(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> SampledToken:
        """The token with its text and the stop string that text completes, if any."""
        text, stop_str = "", None
        if token not in seq.stop_token_ids or seq.params.include_stop_str_in_output:
            detokenizer = self._requests[seq.request_id].detokenizers[seq.choice_index]
            text, stop_str = detokenizer.add([token])
        return SampledToken(seq, token, logprob, text, stop_str)

    def _outputs(self, update: StepUpdate) -> list[RequestOutput]:
        """The step's deltas: a refused request's error, then every request with new tokens."""
        failed = [
            self._fail(seq.request_id, self._requests[seq.request_id], self._grammar_failed(seq))
            for seq in update.refused
        ]
        self._generation_tokens += len(update.appended)
        touched: dict[str, _Request] = {}
        for sample in update.appended:
            seq = sample.seq
            request = touched[seq.request_id] = self._requests[seq.request_id]
            delta = request.pending.get(seq.choice_index)
            if delta is None:
                delta = request.pending[seq.choice_index] = CompletionOutput(
                    index=seq.choice_index,
                    token_ids=[],
                    text="",
                    logprobs=[] if seq.params.logprobs is not None else None,
                )
            delta.token_ids.append(sample.token_id)
            delta.text += sample.text
            if delta.logprobs is not None and sample.logprob is not None:
                delta.logprobs.append(sample.logprob)
        for seq in update.finished:
            request = self._requests[seq.request_id]
            delta = request.pending[seq.choice_index]
            # what it held back (a partial character, a stop string's possible start), if any
            delta.text += request.detokenizers[seq.choice_index].flush()
            delta.finish_reason = seq.finish_reason
        return failed + [self._emit(request_id, request) for request_id, request in touched.items()]

    def _grammar_failed(self, seq: Sequence) -> InvalidRequestError:
        matcher = seq.matcher
        assert isinstance(matcher, GrammarMatcher)
        tokens = seq.num_output_tokens
        if matcher.failure_kind == "too_complex":
            first = matcher.error.strip().splitlines()[0][:300] if matcher.error else ""
            message = (
                f"the constraint is too complex for the grammar library after {tokens} tokens "
                f"of output: {first}"
            )
            code = "grammar_too_complex"
        else:
            message = f"the constraint allows no token after {tokens} tokens of output"
            code = "grammar_dead_end"
        log.warning("request %s: %s", seq.request_id, message)
        self._grammar_failures[code] += 1
        return InvalidRequestError(message, code=code)

    def _fail(self, request_id: str, request: _Request, error: EngineError) -> RequestOutput:
        """Ends the request (the scheduler has ended those it held); its last output carries
        `error`."""
        for seq in request.seqs:  # those never scheduled (their grammar failed to compile)
            if not seq.is_finished:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        request.pending = {}
        output = self._emit(request_id, request)
        output.error = error
        return output

    def _emit(self, request_id: str, request: _Request) -> RequestOutput:
        first = request.seqs[0]
        finished = all(s.is_finished for s in request.seqs)
        queue_time = None
        if not request.started:
            request.started = True
            self._prompt_tokens += first.num_prompt_tokens
            if first.first_scheduled_time is not None:
                queue_time = max(0.0, first.first_scheduled_time - first.arrival_time)
        output = RequestOutput(
            request_id=request_id,
            outputs=[request.pending[i] for i in sorted(request.pending)],
            finished=finished,
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            queue_time_s=queue_time,
        )
        request.pending = {}
        if finished:
            del self._requests[request_id]
            if request.grammar is not None:
                request.grammar.release()
        return output

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self) -> None:
        """Release the weights and the KV cache (engine.model.runner.ModelRunner.sleep); the
        tokenizer, compiled kernels and this object stay. Only with no request in the engine
        (EngineBusyError otherwise); a no-op when asleep."""
        if self._requests:
            count = len(self._requests)
            raise EngineBusyError(f"cannot sleep with {count} request{'s' * (count != 1)} running")
        self.runner.sleep()
        self.block_manager.reset()  # the cached prefixes lived in the freed pools
        self.grammars.clear()  # cached grammars and idle compile workers go too

    def wake_up(self) -> None:
        """Weights and a zeroed KV cache back, with an empty prefix cache; a no-op when awake."""
        self.runner.wake_up()

    def footprint(self) -> MemoryFootprint:
        return self.runner.footprint()

    # --------------------------------------------------------------------------- stats
    def grammar_stats(self) -> CompilerStats:
        """The grammar compiler's memory and outcomes (reads /proc: not once a step)."""
        return self.grammars.stats()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting
            + sum(len(self._requests[r].seqs) for r in self._compiling),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_blocks=self.runner.num_blocks,
            block_size=self.config.block_size,
            grammar_failures=dict(self._grammar_failures),
        )
