"""Sleep and wake as the event loop sees them: one switch at a time, requests refused (503) from
the moment a sleep is accepted until a wake has finished, and the switch itself run on the engine
thread between two steps (engine.core.engine_core.EngineCore.sleep / wake_up)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from engine.errors import EngineBusyError, ServiceUnavailableError
from engine.serving.commands import EngineCommand, Sleep, WakeUp


class SleepSwitch:
    """``send`` hands a command to the engine thread, ``in_flight`` counts the requests a sleep
    would strand, ``check_loaded`` raises unless the model is loaded."""

    def __init__(
        self,
        send: Callable[[EngineCommand], None],
        in_flight: Callable[[], int],
        check_loaded: Callable[[], None],
    ) -> None:
        self._send = send
        self._in_flight = in_flight
        self._check_loaded = check_loaded
        # True from the moment a sleep is accepted until a wake has finished: requests get a 503
        self.sleeping = False
        self._lock = asyncio.Lock()  # one sleep or wake at a time
        self._done: Future | None = None  # the latest one's outcome, set by the thread

    def check_awake(self) -> None:
        """Raise a 503 while the engine sleeps (or is falling asleep or waking)."""
        if self.sleeping:
            raise ServiceUnavailableError(
                "engine is sleeping: POST /wake_up first", code="engine_sleeping"
            )

    async def switch(self, command: type[Sleep] | type[WakeUp]) -> None:
        # A task of its own: a client that disconnects does not interrupt the switch (the thread
        # runs it anyway), and the lock stays held until the thread has finished it.
        await asyncio.shield(asyncio.ensure_future(self._run(command)))

    def fail(self, failure: BaseException) -> None:
        """The engine thread died: a switch it was running ends with ``failure``."""
        if self._done is not None and not self._done.done():
            self._done.set_exception(failure)

    async def _run(self, command: type[Sleep] | type[WakeUp]) -> None:
        self._check_loaded()
        asleep = command is Sleep
        async with self._lock:
            if self.sleeping == asleep:
                return
            if asleep and (count := self._in_flight()):
                raise EngineBusyError(
                    f"cannot sleep with {count} request{'s' * (count != 1)} in flight or queued: "
                    "drain the engine first"
                )
            self.sleeping = True  # from here new requests get a 503, until a wake has finished
            done: Future = Future()
            self._done = done
            self._send(command(done))
            try:
                await asyncio.wrap_future(done)
            except BaseException:
                self.sleeping = not asleep  # a failed sleep leaves it awake, a failed wake asleep
                raise
            self.sleeping = asleep
