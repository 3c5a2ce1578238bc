"""The engine's side of one grammar-compile worker process (engine/structured/worker.py): start
it, hand it one constraint at a time with a wall-clock limit, and kill it when it overruns, is no
longer wanted or has been idle; its lifecycle is a small state machine.

::

    STOPPED ─► STARTING ─► IDLE ◄─► BUSY
                   │          │        │
                   └──────────┴────────┴─► STOPPED (killed, crashed, idle, engine shutting down)

A worker that crashes or is killed mid-compile is simply started again for the next one: its
death costs a compile, never the engine.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from common import processes
from engine.structured.wire import FrameReader, ReadCancelled, ReadTimeout, encode

log = logging.getLogger("engine.structured")

WORKER_STACK_BYTES = 16 * 2**20  # the compile thread's stack in a worker
ENGINE_STACK_FACTOR = 4  # the engine builds grammars a worker passed on a stack this much larger
WORKER_NICE = 10  # below the step loop: compiles take the CPU the engine leaves
START_TIMEOUT_S = 60.0  # interpreter, llguidance and the tokenizer (about 1 s on 2 cores)
STOP_WAIT_S = 5.0


class WorkerState(enum.Enum):
    STOPPED = "stopped"  # no process
    STARTING = "starting"  # spawned, building its tokenizer
    IDLE = "idle"  # ready for a constraint
    BUSY = "busy"  # compiling one


W = WorkerState
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    W.STOPPED: frozenset({W.STARTING}),
    W.STARTING: frozenset({W.IDLE, W.STOPPED}),
    W.IDLE: frozenset({W.BUSY, W.STOPPED}),
    W.BUSY: frozenset({W.IDLE, W.STOPPED}),
}


class WorkerFailed(Exception):
    """The worker died or overran; `message` says how, for the request's 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class WorkerUnavailable(Exception):
    """The worker process could not be started (the engine, not the constraint, is at fault)."""


class WorkerProcess:
    """One worker, driven by the one compile thread that owns it (it forks the process, and the
    process dies with that thread: PR_SET_PDEATHSIG); other threads only read `rss_bytes`."""

    def __init__(self, init: Callable[[], dict[str, Any]], name: str) -> None:
        self._init = init  # makes the first message: tokenizer, limits, memory
        self.name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: FrameReader | None = None
        self._state = W.STOPPED
        self.ready_rss_bytes = 0  # its resident memory once started, the last time it was
        self._lock = threading.Lock()  # state and process, read by stats from other threads

    @property
    def state(self) -> WorkerState:
        return self._state

    def _set_state(self, new: WorkerState, why: str = "") -> None:
        """The one way the worker changes state: checked against TRANSITIONS, logged."""
        old = self._state
        if new not in TRANSITIONS[old]:
            raise RuntimeError(f"compile worker {self.name}: {old.value} -> {new.value}")
        self._state = new
        log.debug("compile worker %s: %s -> %s%s", self.name, old.value, new.value,
                  f" ({why})" if why else "")  # fmt: skip

    def compile(
        self, kind: str, value: str, timeout_s: float, cancelled: threading.Event
    ) -> dict[str, Any]:
        """The worker's answer for one constraint (starting the process first if need be).
        WorkerFailed when it crashed or overran `timeout_s` (it is killed), ReadCancelled when
        `cancelled` was set meanwhile (killed too), WorkerUnavailable when it cannot start."""
        if self._state is W.STOPPED:
            self._start()
        proc, reader = self._proc, self._reader
        assert proc is not None and proc.stdin is not None and reader is not None
        self._set_state(W.BUSY)
        try:
            proc.stdin.write(encode({"kind": kind, "value": value}))
            proc.stdin.flush()
            reply = reader.read(time.monotonic() + timeout_s, cancelled.is_set)
        except BrokenPipeError:
            reply = None
        except ReadTimeout:
            self.stop("timed out")
            raise WorkerFailed(
                f"the constraint did not compile within {timeout_s:g} s "
                "(this engine's --structured-compile-timeout)"
            ) from None
        except ReadCancelled:
            self.stop("its request went away")
            raise
        if reply is None:
            raise WorkerFailed(
                f"the grammar compiler crashed on this constraint ({self._died(proc)})"
            )
        self._set_state(W.IDLE)
        return reply

    def _start(self) -> None:
        self._set_state(W.STARTING)
        first = {**self._init(), "nice": WORKER_NICE}
        command = [
            sys.executable, "-m", "engine.structured.worker", str(os.getpid()),
            str(WORKER_STACK_BYTES),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as error:
            self._set_state(W.STOPPED, str(error))
            raise WorkerUnavailable(f"cannot start a compile worker: {error}") from None
        with self._lock:
            self._proc, self._reader = proc, FrameReader(proc.stdout.fileno())  # type: ignore[union-attr]
        try:
            assert proc.stdin is not None
            proc.stdin.write(encode(first))
            proc.stdin.flush()
            ready = self._reader.read(time.monotonic() + START_TIMEOUT_S, lambda: False)
        except (BrokenPipeError, ReadTimeout):
            ready = None
        if not ready or not ready.get("ready"):
            why = self._died(proc) if proc.poll() is not None else "no answer"
            self.stop(f"did not start: {why}")
            raise WorkerUnavailable(f"the compile worker did not start ({why})")
        self._set_state(W.IDLE, f"pid {proc.pid}")
        self.ready_rss_bytes = self.rss_bytes()

    def _died(self, proc: subprocess.Popen[bytes]) -> str:
        """How `proc` ended (it has, or is about to: its pipe closed)."""
        try:
            code = proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self.stop("crashed")
        if code is None:
            return "it closed its pipe"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def stop(self, why: str) -> None:
        """Kills the process (a compile has no state worth a graceful stop); idempotent."""
        with self._lock:
            proc, self._proc, self._reader = self._proc, None, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        if self._state is not W.STOPPED:
            self._set_state(W.STOPPED, why)

    def rss_bytes(self) -> int:
        """The process's resident memory now (0 when none runs)."""
        with self._lock:
            pid = self._proc.pid if self._proc is not None else None
        return (processes.rss_bytes(pid) or 0) if pid is not None else 0
