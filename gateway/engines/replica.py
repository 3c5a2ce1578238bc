"""One engine process of a local model, and its lifecycle as an explicit state machine.

::

    STOPPED ─► STARTING ─► READY ─► PARKING ─► PARKED ─► WAKING ─► READY
                  │          │                   │          │
                  │          └─► DRAINING ─► STOPPING ─► STOPPED
                  ├─► FAILED      (every running state ─► BACKOFF ─► STARTING after a crash)

STARTING ─► FAILED for an engine that exits by itself before it was ever ready (a config problem);
one killed by a signal (the OOM killer) goes to BACKOFF and is started again. BACKOFF ─► FAILED
only for a replica whose starts keep dying before READY (the pool's ``MAX_CRASHES`` exits or
``MAX_KILLED_STARTS`` kills since it last was): a crash while serving is restarted however often
it happens, since a request may have caused it. FAILED ─► STOPPING is how a failed model is tried
again (a new replica, once its Retry-After has passed: gateway/residency/manager.py).

Only READY takes requests: the router is told the READY replicas of a model on every transition
(the one setter, :meth:`Replica.set_state`, which also logs it and reports it to the metrics). A
transition the table does not allow raises :class:`InvalidTransition`: a supervisor bug shows up
loudly instead of leaving a replica in a state nobody planned for.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.backend import Backend
from gateway.config import ModelConfig
from gateway.engines.logs import EngineLog
from gateway.engines.process import EngineProcess
from gateway.engines.progress import LoadProgress

log = logging.getLogger("modelyard.pool")

LOG_TAIL_LINES = 20
LOG_LINE_CHARS = 1000  # of each, in /admin/models


class ReplicaState(enum.Enum):
    STOPPED = "stopped"  # no process (not started yet, or stopped for good)
    STARTING = "starting"  # process spawned, loading, /ready not yet 200
    READY = "ready"  # serving: in the router
    PARKING = "parking"  # out of the router, finishing its requests, then POST /sleep
    PARKED = "parked"  # process alive, weights and KV cache released (POST /sleep done)
    WAKING = "waking"  # POST /wake_up sent
    DRAINING = "draining"  # out of the router, finishing its requests before it stops
    STOPPING = "stopping"  # SIGTERM sent (SIGKILL after stop_timeout_s)
    BACKOFF = "backoff"  # crashed or killed; restarts after an exponential backoff
    # would not start, or its starts kept dying before READY: no process, replaced by a new replica
    # at the model's next try (a request after its Retry-After, an operator's load, a reload)
    FAILED = "failed"


S = ReplicaState
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.READY, S.BACKOFF, S.FAILED, S.STOPPING}),
    S.READY: frozenset({S.PARKING, S.DRAINING, S.BACKOFF, S.STOPPING}),
    # back to READY: the engine refused to sleep (or could not be reached) and still serves
    S.PARKING: frozenset({S.PARKED, S.READY, S.BACKOFF, S.STOPPING}),
    S.PARKED: frozenset({S.WAKING, S.STOPPING, S.BACKOFF}),
    S.WAKING: frozenset({S.READY, S.BACKOFF, S.STOPPING}),
    S.DRAINING: frozenset({S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPING, S.FAILED}),
    S.FAILED: frozenset({S.STOPPING}),
}
# The replica is on its way out: nothing may start or wake it again.
LEAVING = frozenset({S.DRAINING, S.STOPPING, S.STOPPED, S.FAILED})


class InvalidTransition(RuntimeError):
    """A state change the table does not allow: a bug in whoever asked for it."""


# Called after every transition with the replica and the state it left.
ReplicaListener = Callable[["Replica", ReplicaState], None]


@dataclass(eq=False)
class Replica:
    model: str
    spec: tuple[str, ...]
    config: ModelConfig
    listener: ReplicaListener
    index: int = 0  # its number among the model's replicas (a metrics label)
    port: int = 0
    proc: EngineProcess | None = None  # exec'd, or forked from an engine template
    spin_wait: bool = False  # whether the running process got --spin-wait
    restarts: int = 0
    supervisor: asyncio.Task[None] | None = None
    backend: object | None = None  # its router Backend (gateway.backend), for draining
    since: float = field(default_factory=time.monotonic)  # when the current state began
    started_at: float = 0.0  # when its current process was started (time.monotonic)
    # What the residency manager measured it holding in its current state (ready: with what it
    # may grow by; parked: its floor); None until measured, and again at every transition.
    measured_bytes: int | None = None
    left_after_s: float = 0.0  # how long the state it last left had lasted
    reason: str = ""  # why it entered the current state, as logged
    log: EngineLog | None = None  # where its engine's output goes (the pool sets it)
    progress: LoadProgress | None = None  # while STARTING: the engine's start-up stage
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set on every transition
    _state: ReplicaState = ReplicaState.STOPPED

    @property
    def state(self) -> ReplicaState:
        return self._state

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_state(self, new: ReplicaState, why: str = "") -> None:
        """The one way a replica changes state: checked against TRANSITIONS, logged, reported."""
        old = self._state
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(
                f"replica {self.model}#{self.index}: {old.value} -> {new.value}"
            )
        self._state = new
        self.measured_bytes = None
        self.reason = why
        now = time.monotonic()
        self.left_after_s, self.since = now - self.since, now
        log.log(
            logging.WARNING if new in (S.BACKOFF, S.FAILED) else logging.INFO,
            "replica %s#%d: %s -> %s%s",
            self.model,
            self.index,
            old.value,
            new.value,
            f" ({why})" if why else "",
        )
        self.changed.set()
        self.changed = asyncio.Event()
        self.listener(self, old)

    async def wait_change(self, timeout_s: float) -> None:
        """Returns at the next transition, or after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), max(0.0, timeout_s))

    def describe(self) -> dict[str, object]:
        """What ``/admin/models`` shows of it."""
        now = time.monotonic()
        proc = self.proc if self.proc is not None and self.proc.returncode is None else None
        info: dict[str, object] = {
            "index": self.index,
            "state": self._state.value,
            "for_s": round(now - self.since, 3),
            "url": self.url if self.port else None,
            "pid": proc.pid if proc else None,
            "uptime_s": round(now - self.started_at, 3) if proc else None,
            "restarts": self.restarts,
            "measured_bytes": self.measured_bytes,
            "log": str(self.log.path) if self.log else None,
        }
        if self._state is S.READY:
            info["draining"] = isinstance(self.backend, Backend) and self.backend.draining
        if self._state is S.STARTING and self.progress is not None:
            info["progress"] = self.progress.describe()
        if self._state in (S.FAILED, S.BACKOFF):
            tail = self.log.tail(LOG_TAIL_LINES) if self.log else []
            info["last_log_lines"] = [line[:LOG_LINE_CHARS] for line in tail]
        return info
