"""Bridge between the synchronous EngineCore and the asyncio server.

The core (model load, then step() forever) runs in one dedicated thread so the event loop never
waits on the model: /health and /metrics answer while the model is saturated. Requests, aborts,
sleep and wake travel to that thread as typed commands (engine.serving.commands) in one deque;
outputs come back once per step through ``loop.call_soon_threadsafe`` into one asyncio queue per
request, a sleep's or wake's outcome through its future.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.sequence import RequestOutput
from engine.errors import (
    EngineBusyError,
    EngineError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from engine.serving.commands import AbortRequest, AddRequest, EngineCommand, Sleep, WakeUp
from engine.serving.errors import EngineDeadError
from engine.serving.metrics import EngineMetrics
from engine.serving.requests import RequestLimits, longest_token_chars

if TYPE_CHECKING:
    from engine.core.engine_core import CompilerStats, GrammarTicket

log = logging.getLogger("engine.async")
_T = TypeVar("_T")

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between liveness ticks when nothing arrives


class CoreLike(Protocol):
    """The part of engine.core.engine_core.EngineCore this bridge uses."""

    tokenizer: Any
    max_model_len: int
    max_n: int  # choices one request may ask for
    vocab_size: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...


@runtime_checkable
class FootprintSource(Protocol):
    """A core that measures its memory (EngineCore; test doubles need not)."""

    def footprint(self) -> Any: ...


_ADMITTED = object()  # first item of a request's queue once the core accepted it


@dataclass
class _Request:
    request_id: str
    queue: asyncio.Queue
    arrival: float
    choices: int  # its sequences (n), as the queue bound counts them
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    finish_reasons: dict[int, str] = field(default_factory=dict)


class AsyncEngine:
    """Owns the engine thread; the server talks to the core only through this class."""

    def __init__(
        self,
        core_factory: Callable[[], CoreLike],
        model_name: str,
        max_queue: int,
    ) -> None:
        self._core_factory = core_factory
        self._max_queue = max_queue
        self._commands: collections.deque[EngineCommand] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future | None = None
        self._died: asyncio.Event | None = None
        self._requests: dict[str, _Request] = {}
        self._pending_adds = 0  # sequences sent to the thread and not yet handed to the core
        self._stats: Any = None  # latest core.stats(), replaced (never mutated) by the thread
        # latest core.footprint() (after load, sleep, wake), replaced by the thread; None: unknown
        self.footprint: Any = None
        # True from the moment a sleep is accepted until a wake has finished: requests get a 503
        self.sleeping = False
        self._switching = asyncio.Lock()  # one sleep or wake at a time
        self._switch_done: Future | None = None  # the latest one's outcome, set by the thread
        self.core: CoreLike | None = None
        # HF tokenizers are not thread-safe: the event loop and the prompt thread (templating and
        # tokenising, which can take seconds for a long prompt) each have their own copy.
        self.tokenizer: Any = None
        self._prompt_tokenizer: Any = None
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-prompts")
        self.max_model_len = 0
        self._limits: RequestLimits | None = None
        self.dead: BaseException | None = None
        self.accepting = True
        self.metrics = EngineMetrics(
            model_name,
            lambda: self._stats,
            lambda: self._pending_adds,
            footprint=lambda: self.footprint,
            grammars=self.grammar_stats,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then runs the step loop."""
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        """Return once the model is loaded; re-raise the load error if loading failed."""
        assert self._loaded is not None, "start() first"
        await asyncio.shield(self._loaded)

    async def wait_dead(self) -> BaseException:
        """Return the error that ended the step loop, once it has (after a successful load)."""
        assert self._died is not None, "start() first"
        await self._died.wait()
        assert self.dead is not None
        return self.dead

    @property
    def is_ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        ready = self.dead is None and self.accepting and not self.sleeping
        return self.core is not None and alive and ready

    @property
    def is_alive(self) -> bool:
        return self.dead is None and (self._thread is None or self._thread.is_alive())

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for (known once the model is loaded: check_loaded first)."""
        assert self._limits is not None, "model not loaded"
        return self._limits

    @property
    def num_waiting(self) -> int:
        waiting = self._stats.num_waiting if self._stats is not None else 0
        return waiting + self._pending_adds

    async def drain(self, timeout: float) -> None:
        """Stop taking requests and wait up to ``timeout`` s for those in flight to finish; then
        end the rest with a 503 (streams get it in-band) and abort them in the core."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failure = ServiceUnavailableError(
            "server shut down before the request finished", code="shutting_down"
        )
        now = time.monotonic()
        for request_id, request in list(self._requests.items()):
            if not request.finished:
                request.finished = True
                self._send(AbortRequest(request_id))
                self.metrics.observe_finished("abort", now - request.arrival)
            request.queue.put_nowait(failure)

    async def shutdown(self) -> None:
        """Abort what is still running and stop the thread."""
        for request_id in list(self._requests):
            self._send(AbortRequest(request_id))
        self._stop = True
        self._wake.set()
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)
        compiler = getattr(self.core, "grammars", None)
        if compiler is not None:
            compiler.shutdown()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # ---- requests ----------------------------------------------------------------------------

    def check_loaded(self) -> None:
        """Raise a 503 unless the model (and its tokenizer) is loaded and the loop alive."""
        if self.dead is not None:
            # No Retry-After: this process cannot recover; its supervisor starts a new one.
            raise ServiceUnavailableError(
                "engine loop is not running", code="engine_dead", retry_after_s=None
            )
        if self.core is None:
            raise ServiceUnavailableError("model is still loading", code="not_ready")

    def check_accepting(self, choices: int = 1) -> None:
        """Raise a 503 when a new generation of ``choices`` sequences cannot be taken now: the
        bound counts waiting sequences, so a request with n=8 takes 8 places. (``limits.max_n``
        keeps n within the bound, so every request fits once the queue drains.)"""
        self.check_loaded()
        if not self.accepting:
            raise ServiceUnavailableError("server is shutting down", code="shutting_down")
        self.check_awake()
        waiting = self.num_waiting
        if waiting + choices > self._max_queue:
            raise ServiceUnavailableError(
                f"server overloaded: {waiting} sequences already waiting "
                f"(max queue {self._max_queue}); retry later",
                code="overloaded",
            )

    def check_awake(self) -> None:
        """Raise a 503 while the engine sleeps (or is falling asleep or waking)."""
        if self.sleeping:
            raise ServiceUnavailableError(
                "engine is sleeping: POST /wake_up first", code="engine_sleeping"
            )

    # ---- sleep and wake ----------------------------------------------------------------------

    async def sleep(self) -> None:
        """Release the model's weights and KV cache (engine.core.engine_core.EngineCore.sleep)
        and return once done; a no-op when asleep. EngineBusyError (409) while any request is in
        flight or queued: the caller drains first."""
        await self._switch(Sleep)

    async def wake_up(self) -> None:
        """Bring weights and KV cache back and return once done; a no-op when awake."""
        await self._switch(WakeUp)

    async def _switch(self, command: type[Sleep] | type[WakeUp]) -> None:
        # A task of its own: a client that disconnects does not interrupt the switch (the thread
        # runs it anyway), and the lock stays held until the thread has finished it.
        await asyncio.shield(asyncio.ensure_future(self._run_switch(command)))

    async def _run_switch(self, command: type[Sleep] | type[WakeUp]) -> None:
        self.check_loaded()
        asleep = command is Sleep
        async with self._switching:
            if self.sleeping == asleep:
                return
            if asleep and self._requests:
                count = len(self._requests)
                raise EngineBusyError(
                    f"cannot sleep with {count} request{'s' * (count != 1)} in flight or queued: "
                    "drain the engine first"
                )
            self.sleeping = True  # from here new requests get a 503, until a wake has finished
            done: Future = Future()
            self._switch_done = done
            self._send(command(done))
            try:
                await asyncio.wrap_future(done)
            except BaseException:
                self.sleeping = not asleep  # a failed sleep leaves it awake, a failed wake asleep
                raise
            self.sleeping = asleep

    async def on_prompt_thread(self, work: Callable[[Any], _T]) -> _T:
        """``work(tokenizer)`` on the prompt thread, with that thread's own tokenizer copy: chat
        templates and tokenisation stay off the event loop, so /health and streams keep going
        while a long prompt is processed."""
        self.check_loaded()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_thread, work, self._prompt_tokenizer)

    def request_grammar(self, constraint: StructuredOutput, param: str) -> GrammarTicket:
        """Start (or find cached) the compile of a request's constraint (engine.structured: in a
        worker process, then built on the compiler's threads), so that a bad one is a 400
        naming `param` before the request is accepted and the core finds it compiled. The
        caller awaits it with `wait_grammar` and releases the ticket when the request ends."""
        self.check_loaded()
        compiler = getattr(self.core, "grammars", None)
        if compiler is None:
            raise InvalidRequestError(
                "this engine does not support structured outputs", param=param
            )
        with _naming(param):
            return compiler.request(constraint)

    async def wait_grammar(self, ticket: GrammarTicket, param: str) -> None:
        """Returns once the ticket's grammar has compiled; raises its refusal. Neither this loop
        nor the step loop waits on the compile; a client that leaves releases its ticket (the
        caller's `finally`), which cancels a compile nobody else waits for."""
        with _naming(param):
            # Shielded: cancelling this wait must not cancel the future other requests share.
            await asyncio.shield(asyncio.wrap_future(ticket.future))

    def grammar_stats(self) -> CompilerStats | None:
        stats = getattr(self.core, "grammar_stats", None)  # test doubles have none
        return stats() if stats is not None else None

    @asynccontextmanager
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """Submit a request; on entry it is admitted (admission errors raise here), the yielded
        iterator gives its RequestOutput deltas, and leaving early (client gone) aborts it."""
        self.check_accepting(params.n)
        request = _Request(request_id, asyncio.Queue(), time.monotonic(), params.n)
        self._requests[request_id] = request
        self._pending_adds += params.n
        self._send(AddRequest(request_id, prompt_token_ids, params, request.arrival))
        try:
            first = await request.queue.get()
            if isinstance(first, BaseException):
                raise first
            assert first is _ADMITTED
            yield self._outputs(request)
        finally:
            self._requests.pop(request_id, None)
            if not request.finished:
                self._send(AbortRequest(request_id))
                self.metrics.observe_finished("abort", time.monotonic() - request.arrival)

    async def _outputs(self, request: _Request) -> AsyncIterator[RequestOutput]:
        while True:
            item = await request.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def _send(self, command: EngineCommand) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- event-loop side of the thread's results -----------------------------------------

    def _on_loaded(self, error: BaseException | None) -> None:
        assert self._loaded is not None
        if self._loaded.done():
            return
        if error is None:
            self._loaded.set_result(None)
        else:
            self._loaded.set_exception(error)

    def _on_admission(self, request_id: str, choices: int, error: BaseException | None) -> None:
        self._pending_adds -= choices
        request = self._requests.get(request_id)
        if request is None:
            return
        if error is not None:
            request.finished = True  # never entered the core: nothing to abort
        request.queue.put_nowait(error if error is not None else _ADMITTED)

    def _on_outputs(self, outputs: list[RequestOutput], step_end: float) -> None:
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:  # client already gone; its abort is on the way
                continue
            if out.error is not None:  # ended by the core: the client gets the error
                request.finished = True
                self.metrics.observe_finished("abort", step_end - request.arrival)
                request.queue.put_nowait(out.error)
                continue
            self._observe(request, out, step_end)
            if out.finished:
                request.finished = True
            request.queue.put_nowait(out)

    def _observe(self, request: _Request, out: RequestOutput, now: float) -> None:
        if out.queue_time_s is not None:
            self.metrics.observe_queue_time(out.queue_time_s)
        if any(c.token_ids for c in out.outputs):
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.observe_first_token(now - request.arrival)
            else:
                self.metrics.observe_inter_token(now - (request.last_token_time or now))
            request.last_token_time = now
        for choice in out.outputs:
            if choice.finish_reason is not None:
                request.finish_reasons[choice.index] = choice.finish_reason
        if out.finished:
            reason = request.finish_reasons.get(0) or next(iter(request.finish_reasons.values()))
            self.metrics.observe_finished(reason, now - request.arrival)

    def _on_dead(self, error: BaseException) -> None:
        self.dead = error
        failure = EngineDeadError(f"engine loop failed: {type(error).__name__}: {error}")
        for request in self._requests.values():
            request.finished = True
            request.queue.put_nowait(failure)
        if self._switch_done is not None and not self._switch_done.done():
            self._switch_done.set_exception(failure)
        assert self._died is not None
        self._died.set()

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            core = self._core_factory()
            self.tokenizer = copy.deepcopy(core.tokenizer)
            self._prompt_tokenizer = copy.deepcopy(core.tokenizer)
            self.max_model_len = core.max_model_len
            self._limits = RequestLimits(
                max_model_len=core.max_model_len,
                max_n=min(core.max_n, self._max_queue),
                vocab_size=core.vocab_size,
                longest_token_chars=longest_token_chars(core.tokenizer),
            )
            self._stats = core.stats()
            self._publish_footprint(core)
        except BaseException as error:  # report any load failure to the waiting main task
            self.dead = error
            loop.call_soon_threadsafe(self._on_loaded, error)
            return
        self.core = core
        loop.call_soon_threadsafe(self._on_loaded, None)
        try:
            self._step_loop(core, loop)
        except BaseException as error:
            log.exception("engine loop crashed")
            loop.call_soon_threadsafe(self._on_dead, error)

    def _step_loop(self, core: CoreLike, loop: asyncio.AbstractEventLoop) -> None:
        live: set[str] = set()  # requests inside the core (aborting others is a no-op)
        while not self._stop:
            self._wake.clear()
            self._apply_commands(core, loop, live)
            if not core.has_unfinished():
                self._stats = core.stats()
                self._wake.wait(IDLE_WAIT_S)
                continue
            outputs = core.step()
            step_end = time.monotonic()
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            self._stats = core.stats()
            if outputs:
                loop.call_soon_threadsafe(self._on_outputs, outputs, step_end)

    def _apply_commands(
        self, core: CoreLike, loop: asyncio.AbstractEventLoop, live: set[str]
    ) -> None:
        admitted: list[tuple[str, int, EngineError | None]] = []
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, AddRequest):
                request_id, choices = command.request_id, command.params.n
                try:
                    core.add_request(
                        request_id,
                        command.prompt_token_ids,
                        command.params,
                        arrival_time=command.arrival,
                    )
                except EngineError as error:
                    admitted.append((request_id, choices, error))
                    continue
                live.add(request_id)
                admitted.append((request_id, choices, None))
            elif isinstance(command, AbortRequest):
                if command.request_id in live:
                    core.abort(command.request_id)
                    live.discard(command.request_id)
            else:
                self._apply_switch(core, command)
        if admitted:
            # Publish the core's new waiting count before the event loop stops counting these
            # requests as pending, so load shedding always counts them in one of the two.
            self._stats = core.stats()
            for request_id, choices, error in admitted:
                loop.call_soon_threadsafe(self._on_admission, request_id, choices, error)

    def _apply_switch(self, core: CoreLike, command: Sleep | WakeUp) -> None:
        failure: Exception | None = None
        try:
            if isinstance(command, Sleep):
                core.sleep()
            else:
                core.wake_up()
        except Exception as error:  # the caller's answer; the loop goes on
            if not isinstance(error, EngineError):
                log.exception("%s failed", type(command).__name__)
            failure = error
        self._stats = core.stats()
        self._publish_footprint(core)
        if failure is None:
            command.done.set_result(None)
        else:
            command.done.set_exception(failure)

    def _publish_footprint(self, core: CoreLike) -> None:
        if isinstance(core, FootprintSource):
            self.footprint = core.footprint()


@contextmanager
def _naming(param: str) -> Iterator[None]:
    """A constraint's refusals name the request field that carried it."""
    try:
        yield
    except InvalidRequestError as error:
        raise InvalidRequestError(error.message, param=param, code=error.code) from None
