"""The engine thread: it loads the core, then applies the event loop's commands
(engine.serving.commands) between steps and runs steps while any request is unfinished. The event
loop never waits on it; what it has to tell arrives through ``loop.call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import RequestOutput
from engine.errors import EngineError
from engine.serving.commands import AbortRequest, AddRequest, EngineCommand, Sleep, WakeUp

log = logging.getLogger("engine.async")

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between liveness ticks when nothing arrives


class CoreLike(Protocol):
    """The part of engine.core.engine_core.EngineCore the server uses."""

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


class Listener(Protocol):
    """What the engine thread tells its owner: ``adopt`` runs on the engine thread (the loaded
    core, before any step; raising fails the load), the ``on_*`` calls on the event loop."""

    def adopt(self, core: CoreLike) -> None: ...
    def on_loaded(self, error: BaseException | None) -> None: ...
    def on_admission(self, request_id: str, choices: int, error: BaseException | None) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput], step_end: float) -> None: ...
    def on_dead(self, error: BaseException) -> None: ...


class EngineThread:
    """One thread that owns the core. Other threads only ``send`` commands and read ``stats``
    and ``footprint``, which the thread replaces (never mutates)."""

    def __init__(self, core_factory: Callable[[], CoreLike], listener: Listener) -> None:
        self._core_factory = core_factory
        self._listener = listener
        self._commands: collections.deque[EngineCommand] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats: Any = None  # the latest core.stats()
        self.footprint: Any = None  # the latest core.footprint() (load, sleep, wake); None: unknown

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, command: EngineCommand) -> None:
        self._commands.append(command)
        self._wake.set()

    def stop(self) -> None:
        """Ends the step loop at its next turn."""
        self._stop = True
        self._wake.set()

    async def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            core = self._core_factory()
            self.stats = core.stats()
            self._publish_footprint(core)
            self._listener.adopt(core)
        except BaseException as error:  # report any load failure to the waiting main task
            loop.call_soon_threadsafe(self._listener.on_loaded, error)
            return
        loop.call_soon_threadsafe(self._listener.on_loaded, None)
        try:
            self._step_loop(core, loop)
        except BaseException as error:
            log.exception("engine loop crashed")
            loop.call_soon_threadsafe(self._listener.on_dead, error)

    def _step_loop(self, core: CoreLike, loop: asyncio.AbstractEventLoop) -> None:
        live: set[str] = set()  # requests inside the core (aborting others is a no-op)
        while not self._stop:
            self._wake.clear()
            self._apply_commands(core, loop, live)
            if not core.has_unfinished():
                self.stats = core.stats()
                self._wake.wait(IDLE_WAIT_S)
                continue
            outputs = core.step()
            step_end = time.monotonic()
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            self.stats = core.stats()
            if outputs:
                loop.call_soon_threadsafe(self._listener.on_outputs, outputs, step_end)

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
            self.stats = core.stats()
            for request_id, choices, error in admitted:
                loop.call_soon_threadsafe(self._listener.on_admission, request_id, choices, error)

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
        self.stats = core.stats()
        self._publish_footprint(core)
        if failure is None:
            command.done.set_result(None)
        else:
            command.done.set_exception(failure)

    def _publish_footprint(self, core: CoreLike) -> None:
        if isinstance(core, FootprintSource):
            self.footprint = core.footprint()
