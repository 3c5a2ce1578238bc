"""Grammar compilation off the step loop and out of the engine's reach, with a cache bounded in
bytes.

A constraint is compiled first in a worker process (engine/structured/worker.py: static limits,
metaschema check, the grammar, its first mask and a short probe walk) under a wall-clock limit
(``--structured-compile-timeout``), a stack and an address-space limit: a constraint that crashes
it, overruns or is refused is a 400, and the engine carries on. What the worker passed is then
built again here, on one of the compiler's own threads (a stack four times the worker's, a lower
CPU priority, the GIL released by the library), warmed by its first mask, and cached; each
sequence starts from a copy of it, which costs microseconds. A compile nobody waits for any more
(its client went away) is cancelled, its worker killed.

The cache (engine/structured/cache.py) holds at most ``--structured-cache-memory`` bytes of
grammars, counting those running requests hold; a request holds its grammar through a
`GrammarTicket` from `request` until it ends.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import llguidance

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequestError, ServiceUnavailableError
from engine.structured.bitmask import allocate_bitmask, fill_row
from engine.structured.cache import FAILURE_BYTES, CacheEntry, GrammarCache
from engine.structured.grammars import Constraint
from engine.structured.limits import ConstraintLimits, check_size, too_complex
from engine.structured.matcher import GrammarMatcher
from engine.structured.wire import ReadCancelled
from engine.structured.workers import (
    ENGINE_STACK_FACTOR,
    WORKER_NICE,
    WORKER_STACK_BYTES,
    WorkerFailed,
    WorkerProcess,
    WorkerUnavailable,
)

log = logging.getLogger("engine.structured")

MAX_CACHED_GRAMMARS = 256
WORKER_IDLE_S = 120.0  # a worker without a compile for this long exits (its memory goes)
POLL_S = 1.0  # how often an idle compile thread looks for a stop request
# A worker's resident memory before one has been measured: the interpreter, llguidance and its
# tokenizer (about 100 MB for a 49k vocabulary).
WORKER_RSS_ESTIMATE = 128 * 2**20
# The vocabulary's memory in the engine once built (llguidance's tokenizer and the JSON it is built
# from): 1.06 KiB a token for Gemma 3's 262,144 (280 MB); counted as headroom until then.
VOCABULARY_BYTES_PER_TOKEN = 1088


@dataclass(frozen=True)
class CompileSettings:
    """How compiles run (the engine's --structured-* flags)."""

    timeout_s: float = 5.0
    cache_memory: int = 256 * 2**20
    workers: int = 1
    max_pending: int = 64  # compiles waiting for a worker, beyond which new ones get a 503
    max_entries: int = MAX_CACHED_GRAMMARS
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)

    @classmethod
    def of(cls, config: EngineConfig) -> CompileSettings:
        return cls(
            config.structured_compile_timeout_s,
            config.structured_cache_memory,
            config.structured_compile_workers,
        )


@dataclass(frozen=True)
class CompilerStats:
    """For /status and /metrics."""

    cache_bytes: int  # grammars cached or in use, as measured when compiled
    cache_budget_bytes: int
    cached_grammars: int
    workers_rss_bytes: int  # the worker processes now (outside the engine's own RSS)
    # what structured outputs may add to the engine's RSS: the budget not yet used, the workers
    # (outside that RSS), every one of them at its measured size, and the vocabulary until the
    # first compile has built it
    headroom_bytes: int
    compiles: dict[str, int]  # outcome -> count: ok, refused codes, cancelled


class CompiledGrammar:
    """A checked grammar; `matcher()` starts a sequence on it."""

    def __init__(self, prototype: llguidance.LLMatcher, size_bytes: int) -> None:
        self._prototype = prototype  # never advanced: only copied
        self.size_bytes = size_bytes

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarTicket:
    """One holder's claim on a constraint's compile and, once compiled, on its grammar: while
    held, the grammar stays in the cache; once nobody holds a compile still under way, it is
    cancelled."""

    def __init__(self, cache: GrammarCache, entry: CacheEntry) -> None:
        self._cache = cache
        self._entry: CacheEntry | None = entry
        self.future: Future[CompiledGrammar] = entry.future

    def release(self) -> None:
        """Idempotent."""
        entry, self._entry = self._entry, None
        if entry is not None:
            self._cache.release(entry)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | set[int],
        settings: CompileSettings | None = None,
    ) -> None:
        self.settings = settings or CompileSettings()
        # structured outputs need the Rust tokenizer's JSON; slow (Python) tokenizers have none
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._vocab_size = vocab_size  # the logits' width, which the masks cover
        self._eos_token_ids = sorted(eos_token_ids)
        # The tokenizer's JSON (the workers build their own vocabulary from it) and llguidance's
        # view of the vocabulary, built by the first compile, not with the model: for Gemma's
        # 262,144 tokens 3.4 s and VOCABULARY_BYTES_PER_TOKEN's 280 MB that an engine nobody asks
        # for structured outputs never needs. Building it holds the GIL throughout, so that first
        # compile stalls the engine's other requests once.
        self._vocabulary_lock = threading.Lock()
        self._built_vocabulary: tuple[str, llguidance.LLTokenizer] | None = None
        self._cache = GrammarCache(self.settings.cache_memory, self.settings.max_entries)
        self._jobs: queue.Queue[CacheEntry | None] = queue.Queue()
        self._workers: list[WorkerProcess] = []
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._stop_generation = 0  # clear() bumps it: idle workers stop
        self._closed = False
        self._outcomes: Counter[str] = Counter()

    # ---- what callers use ----

    def request(self, constraint: Constraint) -> GrammarTicket:
        """A claim on `constraint`'s grammar: cached, or compiling from now. Its future raises
        InvalidRequestError for a constraint that cannot be used, ServiceUnavailableError when
        the engine cannot compile it now. Raises at once for one over the size limit or when
        too many compiles are waiting."""
        if self._backend is None:
            raise InvalidRequestError(
                "structured outputs need a fast (Rust) tokenizer, which this model lacks",
                param="response_format",
            )
        if self._closed:
            raise ServiceUnavailableError("the engine is shutting down", code="shutting_down")
        check_size(constraint.value, self.settings.limits)
        entry, made = self._cache.hold(constraint)
        ticket = GrammarTicket(self._cache, entry)
        if made:
            if self._jobs.qsize() >= self.settings.max_pending:
                ticket.release()
                raise ServiceUnavailableError(
                    f"{self._jobs.qsize()} constraints are already waiting to compile; retry later",
                    code="overloaded",
                )
            self._start_threads()
            self._jobs.put(entry)
        return ticket

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The grammar, waiting for it (offline use and tests); the cache may evict it once
        this returns."""
        ticket = self.request(constraint)
        try:
            return ticket.future.result()
        finally:
            ticket.release()

    def clear(self) -> None:
        """Drops the grammars nobody holds and stops idle workers (the engine falls asleep)."""
        self._cache.clear()
        self._stop_generation += 1

    def shutdown(self) -> None:
        self._closed = True
        while True:
            try:
                entry = self._jobs.get_nowait()
            except queue.Empty:
                break
            if entry is not None:
                self._finish(entry, ServiceUnavailableError("shutting down", "shutting_down"))
        for _ in self._threads:
            self._jobs.put(None)

    def stats(self) -> CompilerStats:
        cache = self._cache
        rss = [w.rss_bytes() for w in self._workers]
        started = [w.ready_rss_bytes for w in self._workers if w.ready_rss_bytes]
        each = max(started) if started else WORKER_RSS_ESTIMATE
        workers_at_most = self.settings.workers * each
        return CompilerStats(
            cache_bytes=cache.charged_bytes,
            cache_budget_bytes=cache.budget_bytes,
            cached_grammars=len(cache),
            workers_rss_bytes=sum(rss),
            headroom_bytes=max(0, cache.budget_bytes - cache.charged_bytes)
            + max(workers_at_most, sum(rss))
            + (
                0
                if self._built_vocabulary is not None
                else self._vocab_size * VOCABULARY_BYTES_PER_TOKEN
            ),
            compiles=dict(self._outcomes),
        )

    # ---- the compile threads ----

    def _start_threads(self) -> None:
        """The compile threads, started with the first compile: each owns one worker process,
        and its stack bounds the grammars it builds (ENGINE_STACK_FACTOR x the worker's)."""
        with self._threads_lock:
            if self._threads:
                return
            old = threading.stack_size(WORKER_STACK_BYTES * ENGINE_STACK_FACTOR)
            try:
                for index in range(self.settings.workers):
                    worker = WorkerProcess(self._worker_init, name=str(index))
                    thread = threading.Thread(
                        target=self._serve, args=(worker,), name=f"engine-grammar-{index}",
                        daemon=True,  # a compile under way must not hold up the process's exit
                    )  # fmt: skip
                    self._workers.append(worker)
                    self._threads.append(thread)
                    thread.start()
            finally:
                threading.stack_size(old)

    def _vocabulary(self) -> tuple[str, llguidance.LLTokenizer]:
        """The tokenizer's JSON and llguidance's tokenizer, built by the first caller (a compile
        thread) while any other waits."""
        with self._vocabulary_lock:
            if self._built_vocabulary is None:
                assert self._backend is not None  # request() refuses constraints without one
                started = time.monotonic()
                text = self._backend.to_str()
                ll_tokenizer = llguidance.LLTokenizer(
                    text, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
                self._built_vocabulary = text, ll_tokenizer
                log.info(
                    "structured outputs' vocabulary built in %.2f s", time.monotonic() - started
                )
            return self._built_vocabulary

    def _worker_init(self) -> dict[str, Any]:
        """The first message of a starting worker (engine.structured.worker)."""
        limits = self.settings.limits
        return {
            "tokenizer": self._vocabulary()[0],
            "vocab_size": self._vocab_size,
            "eos_token_ids": self._eos_token_ids,
            "limits": {name: getattr(limits, name) for name in limits.__dataclass_fields__},
            # one grammar at most the whole budget, and room to find out it is larger
            "memory_bytes": 2 * self.settings.cache_memory + 512 * 2**20,
        }

    def _serve(self, worker: WorkerProcess) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        generation = self._stop_generation
        last_job = time.monotonic()
        while True:
            try:
                entry = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                idle = time.monotonic() - last_job > WORKER_IDLE_S
                if idle or generation != self._stop_generation:
                    generation = self._stop_generation
                    worker.stop("idle" if idle else "engine asleep")
                continue
            if entry is None:
                worker.stop("engine shutting down")
                return
            if not entry.cancelled.is_set():
                self._compile(worker, entry)
            last_job = time.monotonic()

    def _compile(self, worker: WorkerProcess, entry: CacheEntry) -> None:
        constraint: Constraint = entry.key
        started = time.monotonic()
        try:
            reply = worker.compile(
                constraint.kind, constraint.value, self.settings.timeout_s, entry.cancelled
            )
        except ReadCancelled:
            self._outcomes["cancelled"] += 1
            return
        except WorkerFailed as failure:
            log.warning("a %s constraint was refused: %s", constraint.kind, failure.message)
            self._finish(entry, too_complex(failure.message))
            return
        except WorkerUnavailable as error:
            log.error("%s", error)
            self._finish(entry, ServiceUnavailableError(str(error), code="compile_unavailable"))
            return
        if not reply["ok"]:
            error = InvalidRequestError(reply["message"], param="response_format",
                                        code=reply["code"])  # fmt: skip
            self._finish(entry, error)
            return
        size = int(reply["bytes"])
        if size > self._cache.budget_bytes:
            self._finish(entry, too_complex(
                f"the grammar takes {size / 2**20:.0f} MiB, more than this engine's whole "
                f"budget for grammars ({self._cache.budget_bytes / 2**20:.0f} MiB, "
                "--structured-cache-memory)"
            ))  # fmt: skip
            return
        if not self._cache.charge(entry, size):
            self._finish(entry, ServiceUnavailableError(
                "the grammars of running requests fill this engine's budget for grammars "
                "(--structured-cache-memory); retry later", code="overloaded",
            ))  # fmt: skip
            return
        prototype = self._build(reply["grammar"])
        if prototype.is_error():  # what the worker passed: a bug if it ever differs here
            log.error("a grammar the worker passed failed here: %s", prototype.get_error())
            self._finish(entry, too_complex("the grammar failed to build in the engine"))
            return
        self._finish(entry, CompiledGrammar(prototype, size))
        log.debug("compiled a %s constraint in %.3f s (%d bytes)", constraint.kind,
                  time.monotonic() - started, size)  # fmt: skip

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        """The grammar a worker passed, built here and warmed by its first mask (where
        llguidance does most of its lazy work)."""
        prototype = llguidance.LLMatcher(self._vocabulary()[1], grammar, log_level=0)
        fill_row(prototype, allocate_bitmask(1, self._vocab_size), 0)
        return prototype

    def _finish(self, entry: CacheEntry, result: CompiledGrammar | EngineError) -> None:
        """Settles `entry`'s future. Refusals of the constraint stay cached (charged a little);
        a refusal that says nothing about it (the engine is busy or shutting down) does not."""
        if isinstance(result, CompiledGrammar):
            outcome = "ok"
        else:
            outcome = result.code or "invalid"
            if isinstance(result, InvalidRequestError):
                if not self._cache.charge(entry, FAILURE_BYTES):
                    self._cache.forget(entry)
            else:
                self._cache.forget(entry)
        self._outcomes[outcome] += 1
        try:
            if isinstance(result, CompiledGrammar):
                entry.future.set_result(result)
            else:
                entry.future.set_exception(result)
        except InvalidStateError:  # cancelled meanwhile: its holders are gone
            pass
