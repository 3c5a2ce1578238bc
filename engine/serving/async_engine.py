"""Bridge between the synchronous EngineCore and the asyncio server.

The core (model load, then step() forever) runs in its own thread (engine.serving.engine_thread)
so the event loop never waits on the model: /health and /metrics answer while the model is
saturated. Requests, aborts, sleep and wake travel to that thread as typed commands
(engine.serving.commands); outputs come back once per step into one asyncio queue per request,
a sleep's or wake's outcome through its future (engine.serving.sleep_switch). Each request's
latencies go to the metrics through engine.serving.request_stats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.sequence import RequestOutput
from engine.errors import InvalidRequestError, ServiceUnavailableError
from engine.serving.commands import AbortRequest, AddRequest, Sleep, WakeUp
from engine.serving.engine_thread import CoreLike, EngineThread
from engine.serving.errors import EngineDeadError
from engine.serving.metrics import EngineMetrics
from engine.serving.request_stats import RequestStats
from engine.serving.requests import RequestLimits, longest_token_chars
from engine.serving.sleep_switch import SleepSwitch

if TYPE_CHECKING:
    from engine.core.engine_core import CompilerStats, GrammarTicket

_T = TypeVar("_T")

_ADMITTED = object()  # first item of a request's queue once the core accepted it


@dataclass
class _Request:
    queue: asyncio.Queue  # _ADMITTED or its error, then its outputs (or an error that ends it)
    stats: RequestStats
    finished: bool = False


class AsyncEngine:
    """Owns the engine thread; the server talks to the core only through this class."""

    def __init__(
        self,
        core_factory: Callable[[], CoreLike],
        model_name: str,
        max_queue: int,
    ) -> None:
        self._max_queue = max_queue
        self._thread = EngineThread(core_factory, self)
        self._loaded: asyncio.Future | None = None
        self._died: asyncio.Event | None = None
        self._requests: dict[str, _Request] = {}
        self._pending_adds = 0  # sequences sent to the thread and not yet handed to the core
        self._preparing = 0  # sequences of requests being templated, tokenised, compiled
        self._switch = SleepSwitch(
            self._thread.send, lambda: len(self._requests), self.check_loaded
        )
        self.core: CoreLike | None = None
        # The core's tokenizer, shared by the engine thread (detokenising), the event loop and the
        # prompt thread (templates, tokenising): see kept_tokenizers.shareable_tokenizer.
        self.tokenizer: Any = None
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-prompts")
        self.max_model_len = 0
        self._limits: RequestLimits | None = None
        self.dead: BaseException | None = None
        self.accepting = True
        self.metrics = EngineMetrics(
            model_name,
            lambda: self._thread.stats,
            lambda: self._preparing + self._pending_adds,
            footprint=lambda: self.footprint,
            grammars=self.grammar_stats,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then runs the step loop."""
        loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()
        self._died = asyncio.Event()
        self._thread.start(loop)

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
        ready = self.dead is None and self.accepting and not self.sleeping
        return self.core is not None and self._thread.is_alive() and ready

    @property
    def is_alive(self) -> bool:
        return self.dead is None and (not self._thread.started or self._thread.is_alive())

    @property
    def sleeping(self) -> bool:
        """From the moment a sleep is accepted until a wake has finished."""
        return self._switch.sleeping

    @property
    def footprint(self) -> Any:
        """The core's latest memory footprint (after load, sleep, wake); None: unknown."""
        return self._thread.footprint

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
        stats = self._thread.stats
        waiting = stats.num_waiting if stats is not None else 0
        return waiting + self._preparing + self._pending_adds

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
                self._thread.send(AbortRequest(request_id))
                request.stats.aborted(now)
            request.queue.put_nowait(failure)

    async def shutdown(self) -> None:
        """Abort what is still running and stop the thread."""
        for request_id in list(self._requests):
            self._thread.send(AbortRequest(request_id))
        self._thread.stop()
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)
        compiler = getattr(self.core, "grammars", None)
        if compiler is not None:
            compiler.shutdown()
        await self._thread.join(30.0)

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

    @contextmanager
    def preparing(self, choices: int) -> Iterator[None]:
        """Holds ``choices`` places of the queue bound while a request is prepared: templated
        and tokenised on the prompt thread (one at a time), its grammar compiled. Such requests
        wait as much as those in the core, and without places of their own a flood of long
        prompts would line up at the prompt thread past any bound. check_accepting's 503 when
        the places are not there; `generate` takes them over (no await in between)."""
        self.check_accepting(choices)
        self._preparing += choices
        try:
            yield
        finally:
            self._preparing -= choices

    def check_awake(self) -> None:
        """Raise a 503 while the engine sleeps (or is falling asleep or waking)."""
        self._switch.check_awake()

    # ---- sleep and wake ----------------------------------------------------------------------

    async def sleep(self) -> None:
        """Release the model's weights and KV cache (engine.core.engine_core.EngineCore.sleep)
        and return once done; a no-op when asleep. EngineBusyError (409) while any request is in
        flight or queued: the caller drains first."""
        await self._switch.switch(Sleep)

    async def wake_up(self) -> None:
        """Bring weights and KV cache back and return once done; a no-op when awake."""
        await self._switch.switch(WakeUp)

    async def on_prompt_thread(self, work: Callable[[Any], _T]) -> _T:
        """``work(tokenizer)`` on the prompt thread: chat templates and tokenisation stay off the
        event loop, so /health and streams keep going while a long prompt is processed."""
        self.check_loaded()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_thread, work, self.tokenizer)

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
        stats = RequestStats(self.metrics, time.monotonic())
        request = _Request(asyncio.Queue(), stats)
        self._requests[request_id] = request
        self._pending_adds += params.n
        self._thread.send(AddRequest(request_id, prompt_token_ids, params, stats.arrival))
        try:
            first = await request.queue.get()
            if isinstance(first, BaseException):
                raise first
            assert first is _ADMITTED
            yield self._outputs(request)
        finally:
            self._requests.pop(request_id, None)
            if not request.finished:
                self._thread.send(AbortRequest(request_id))
                request.stats.aborted(time.monotonic())

    async def _outputs(self, request: _Request) -> AsyncIterator[RequestOutput]:
        while True:
            item = await request.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # ---- what the engine thread reports (engine.serving.engine_thread.Listener) ------------

    def adopt(self, core: CoreLike) -> None:
        """On the engine thread, once the core has loaded: what serving needs of it."""
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self._limits = RequestLimits(
            max_model_len=core.max_model_len,
            max_n=min(core.max_n, self._max_queue),
            vocab_size=core.vocab_size,
            longest_token_chars=longest_token_chars(core.tokenizer),
        )
        self.core = core

    def on_loaded(self, error: BaseException | None) -> None:
        assert self._loaded is not None
        if self._loaded.done():
            return
        if error is None:
            self._loaded.set_result(None)
        else:
            self.dead = error
            self._loaded.set_exception(error)

    def on_admission(self, request_id: str, choices: int, error: BaseException | None) -> None:
        self._pending_adds -= choices
        request = self._requests.get(request_id)
        if request is None:
            return
        if error is not None:
            request.finished = True  # never entered the core: nothing to abort
        request.queue.put_nowait(error if error is not None else _ADMITTED)

    def on_outputs(self, outputs: list[RequestOutput], step_end: float) -> None:
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:  # client already gone; its abort is on the way
                continue
            if out.error is not None:  # ended by the core: the client gets the error
                request.finished = True
                request.stats.aborted(step_end)
                request.queue.put_nowait(out.error)
                continue
            request.stats.observe(out, step_end)
            if out.finished:
                request.finished = True
            request.queue.put_nowait(out)

    def on_dead(self, error: BaseException) -> None:
        self.dead = error
        failure = EngineDeadError(f"engine loop failed: {type(error).__name__}: {error}")
        for request in self._requests.values():
            request.finished = True
            request.queue.put_nowait(failure)
        self._switch.fail(failure)
        assert self._died is not None
        self._died.set()


@contextmanager
def _naming(param: str) -> Iterator[None]:
    """A constraint's refusals name the request field that carried it."""
    try:
        yield
    except InvalidRequestError as error:
        raise InvalidRequestError(error.message, param=param, code=error.code) from None
