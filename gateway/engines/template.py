"""Engine templates, the gateway's side: processes (``python -m engine.template``) that have
imported what an engine needs and fork engines on request, so that an engine starts without
seconds of imports and shares the interpreter's and torch's pages with its template.

One template per OpenMP wait policy (libgomp reads it once, when torch loads: an engine with
``--spin-wait`` comes from the spinning template), started when a fleet with local models is
applied, or at its first fork. A fork request carries the engine's flags, its working directory
and the write end of its output pipe; the template answers with the engine's pid, and later with
its wait status (it is the engine's parent: only it can reap it). A ``ForkedEngine`` is what the
pool sees of such an engine: pid, returncode, stdout and wait(), as an asyncio subprocess has.

A template that is not there when asked (it failed to start, died, or does not answer) makes the
pool exec the engine as before, with a warning; a new one is started at a fork request after
``RESTART_AFTER_S``. Its engines die with it (their parent-death signal; it dies with the
gateway), and are reported killed by SIGKILL: the pool restarts them as it would after an OOM
kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from typing import Any

from common.processes import alive, pss_bytes
from common.template_wire import (
    EXITED,
    FORK,
    FORKED,
    MAX_MESSAGE_BYTES,
    PREPARE,
    READY,
    TEMPLATE_MODULE,
    WireError,
    decode,
    encode,
    send,
    template_argv,
)
from gateway.engines.logs import EngineLog, EngineLogs
from gateway.engines.process import die_with_gateway, relay_output, send_signal

log = logging.getLogger("modelyard.pool")

START_TIMEOUT_S = 120.0  # its imports, on a busy small machine
FORK_TIMEOUT_S = 10.0  # a fork request's answer (a fork takes milliseconds)
RESTART_AFTER_S = 30.0  # after a template died, engines are exec'd this long before a new try
STOP_TIMEOUT_S = 5.0
ORPHAN_WAIT_S = 5.0  # an engine whose template died is gone within this (its death signal)
LOG_TAIL_LINES = 20  # of its output, in the warning when it is gone


def wait_policy(spin_wait: bool) -> str:
    """A template's name: its OpenMP wait policy."""
    return "spin-wait" if spin_wait else "passive"


class TemplateUnavailable(RuntimeError):
    """The template cannot fork this engine: the pool execs it instead."""


class ForkedEngine:
    """An engine forked by a template, with what the pool uses of an asyncio subprocess."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = None  # set before the pool sees it
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def ended(self, returncode: int) -> None:
        """Its template reaped it (or died: then it was SIGKILLed with it)."""
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set_result(returncode)


class TemplateState(enum.Enum):
    STARTING = "starting"  # being spawned, importing
    READY = "ready"  # takes fork requests
    STOPPING = "stopping"  # the gateway closed its end
    GONE = "gone"  # exited (or never started)


_T = TemplateState
# Where each state may go (EngineTemplate._set_state); GONE is final: a new template replaces it.
TEMPLATE_TRANSITIONS: dict[TemplateState, frozenset[TemplateState]] = {
    _T.STARTING: frozenset({_T.READY, _T.STOPPING, _T.GONE}),
    _T.READY: frozenset({_T.STOPPING, _T.GONE}),
    _T.STOPPING: frozenset({_T.GONE}),
    _T.GONE: frozenset(),
}


class EngineTemplate:
    """One template process and its socket: start, fork, stop; the engines it forked, until
    each is reaped."""

    def __init__(
        self, spin_wait: bool, cwd: str | None, output: EngineLog, module: str = TEMPLATE_MODULE
    ) -> None:
        self.spin_wait = spin_wait
        self.cwd = cwd
        self.output = output  # its own output (its engines' go to theirs)
        self.module = module
        self.state = TemplateState.STARTING  # made to be started
        self.gone_at = 0.0
        self.proc: asyncio.subprocess.Process | None = None
        self.engines: dict[int, ForkedEngine] = {}
        self._sock: socket.socket | None = None
        self._ready = asyncio.Event()
        # fork requests awaiting their answer: the engine's future and its output pipe's read end
        self._pending: dict[int, tuple[asyncio.Future[ForkedEngine], int]] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: asyncio.Task[None] | None = None
        self._fork_lock = asyncio.Lock()
        self._prepared: set[tuple[str | None, ...]] = set()  # what it was asked to prepare for

    @property
    def policy(self) -> str:
        return wait_policy(self.spin_wait)

    def start(self) -> None:
        """Spawns it in the background; ``wait_ready`` for its imports."""
        self._starting = asyncio.create_task(self._spawn())

    async def _spawn(self) -> None:
        """Spawns it (dying with the gateway, in its own session) with its end of the socket."""
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as error:
            self._gone(f"no socket pair: {error}")
            return
        command = [
            *die_with_gateway(),
            sys.executable, "-m", self.module, *template_argv(theirs.fileno(), self.spin_wait),
        ]  # fmt: skip
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *command,
                cwd=self.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as error:
            ours.close()
            self._gone(f"cannot start: {error}")
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        log.info("engine template (%s) starting: pid %d", self.policy, self.proc.pid)
        self._tasks = [
            asyncio.create_task(relay_output(self.proc, self.output)),
            asyncio.create_task(self._read()),
        ]

    async def wait_ready(self, timeout_s: float) -> bool:
        if self.state is TemplateState.STARTING:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self.state is TemplateState.READY

    async def fork(self, argv: list[str], cwd: str | None) -> ForkedEngine:
        """Forks an engine with the `python -m engine` flags ``argv``; raises TemplateUnavailable
        when this template cannot."""
        if self.state is not TemplateState.READY or self._sock is None:
            raise TemplateUnavailable(f"the template is {self.state.value}")
        read_end, write_end = os.pipe()
        request = next(self._ids)
        answer: asyncio.Future[ForkedEngine] = asyncio.get_running_loop().create_future()
        self._pending[request] = (answer, read_end)
        try:
            async with self._fork_lock:  # one request in the socket's buffer at a time
                await self._send(encode(FORK, id=request, argv=argv, cwd=cwd), [write_end])
            os.close(write_end)
            write_end = -1
            engine = await asyncio.wait_for(answer, FORK_TIMEOUT_S)
        except (OSError, WireError, TimeoutError) as error:
            os.close(read_end)
            raise TemplateUnavailable(str(error) or type(error).__name__) from None
        except TemplateUnavailable:
            os.close(read_end)
            raise
        finally:
            self._pending.pop(request, None)
            if write_end >= 0:
                os.close(write_end)
        engine.stdout = await _reader(read_end)
        return engine

    async def prepare(self, argv: list[str], cwd: str | None) -> None:
        """Asks it to prepare, when idle, for an engine it may fork later with the flags
        ``argv``, once (nothing is answered; a template that cannot is left alone)."""
        key = (cwd, *argv)
        if self.state is not TemplateState.READY or self._sock is None or key in self._prepared:
            return
        self._prepared.add(key)
        try:
            async with self._fork_lock:
                await self._send(encode(PREPARE, argv=argv, cwd=cwd), [])
        except (OSError, WireError) as error:
            log.debug("engine template (%s): prepare not sent: %s", self.policy, error)

    async def stop(self) -> None:
        """Ends its side of the socket (it exits, and engines still running die with it; one
        still importing reads nothing, and is killed), waits for it."""
        importing = self.state is TemplateState.STARTING
        if self.state in (TemplateState.STARTING, TemplateState.READY):  # else reaped below
            self._set_state(TemplateState.STOPPING)
        if self._starting is not None:
            await self._starting
        if self._sock is not None and self.state is TemplateState.STOPPING:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)  # its receive sees the end
        if self.proc is not None:
            if importing:
                send_signal(self.proc, signal.SIGKILL)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                send_signal(self.proc, signal.SIGKILL)
                await self.proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, STOP_TIMEOUT_S)

    def pss_bytes(self) -> int:
        """Its proportional set size: its pages shared with its engines count a share each."""
        if self.proc is None or self.state is TemplateState.GONE:
            return 0
        return pss_bytes(self.proc.pid) or 0

    # ---- its messages ----

    async def _send(self, data: bytes, fds: list[int]) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                send(self._sock, data, fds)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self._sock.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(self._sock.fileno())

    async def _read(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        why = "it closed its socket"
        try:
            while True:
                data = await loop.sock_recv(self._sock, MAX_MESSAGE_BYTES)
                if not data:
                    break
                self._handle(decode(data))
        except (OSError, WireError) as error:
            why = str(error)
        finally:
            self._gone(why)

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if kind == READY:
            if self.state is not TemplateState.STARTING:  # ready as the gateway stops it
                return
            self._set_state(TemplateState.READY)
            self._ready.set()
            log.info("engine template (%s) ready: pid %s, imports %.1fs", self.policy,
                     message.get("pid"), message.get("imports_s", 0.0))  # fmt: skip
        elif kind == FORKED:
            answer, _ = self._pending.get(message.get("id"), (None, -1))  # type: ignore[arg-type]
            if answer is None or answer.done():
                if isinstance(message.get("pid"), int):  # its request gave up: nobody runs it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(message["pid"], signal.SIGKILL)
                return
            if isinstance(message.get("pid"), int):
                # Known at once: its exit may be the very next message, before fork() resumes.
                engine = self.engines[message["pid"]] = ForkedEngine(message["pid"])
                answer.set_result(engine)
            else:
                answer.set_exception(TemplateUnavailable(str(message.get("error"))))
        elif kind == EXITED:
            engine = self.engines.pop(message.get("pid"), None)  # type: ignore[arg-type]
            if engine is not None:
                engine.ended(os.waitstatus_to_exitcode(message["status"]))

    def _set_state(self, new: TemplateState) -> None:
        """The one way its state changes, along TEMPLATE_TRANSITIONS."""
        if new not in TEMPLATE_TRANSITIONS[self.state]:
            raise RuntimeError(
                f"engine template: {self.state.value} -> {new.value} is not a transition"
            )
        self.state = new

    def _gone(self, why: str) -> None:
        """It exited or cannot be reached: what waited on it learns so, its engines end."""
        was = self.state
        if was is TemplateState.GONE:
            return
        self._set_state(TemplateState.GONE)
        self.gone_at = time.monotonic()
        self._ready.set()
        if self._sock is not None:
            self._sock.close()
        for answer, _ in self._pending.values():
            if not answer.done():
                answer.set_exception(TemplateUnavailable(f"the template is gone: {why}"))
        if was is not TemplateState.STOPPING:
            log.warning("engine template (%s) gone (%s); %d engines die with it; last lines:\n%s",
                        self.policy, why, len(self.engines),
                        "\n".join(self.output.tail(LOG_TAIL_LINES)))  # fmt: skip
        orphans, self.engines = list(self.engines.values()), {}
        for engine in orphans:
            self._tasks.append(asyncio.create_task(_reap_orphan(engine)))


async def _reader(fd: int) -> asyncio.StreamReader:
    """An asyncio stream over the read end of an engine's output pipe (closed at its EOF)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)  # asyncio subprocesses' limit
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", 0)
    )
    return reader


async def _reap_orphan(engine: ForkedEngine) -> None:
    """An engine whose template died gets SIGKILL from the kernel (its parent-death signal) and
    is reaped by whoever inherits it: it ended killed by SIGKILL once it is gone (or a zombie)."""
    deadline = time.monotonic() + ORPHAN_WAIT_S
    try:
        while alive(engine.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:  # cancelled too (the gateway stopping): its waiters must not wait forever
        engine.ended(-signal.SIGKILL)


class EngineTemplates:
    """The pool's templates, one per wait policy: which are wanted (``configure``), forking
    through the right one, falling back (None) when it is not there, restarting it later."""

    def __init__(self, cwd: str | None, logs: EngineLogs, module: str = TEMPLATE_MODULE) -> None:
        self.cwd = cwd
        self.logs = logs  # where each template's own output goes
        self.module = module  # what `python -m` runs as the template
        self.enabled = False
        self.wanted: set[bool] = set()  # the wait policies (spin-wait or not) local models use
        # per wait policy, the engines (their flags) a template prepares for once ready
        self.ahead: dict[bool, list[list[str]]] = {}
        self._templates: dict[bool, EngineTemplate] = {}
        self._retiring: set[EngineTemplate] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def configure(
        self,
        enabled: bool,
        policies: set[bool],
        ahead: dict[bool, list[list[str]]] | None = None,
    ) -> None:
        """Templates for ``policies`` start now (when ``enabled``, on Linux: a child's death
        signal, SOCK_SEQPACKET and /proc are Linux's); ones nobody wants any more stop once
        their engines are gone. ``ahead``: per policy, the flags of engines started later (on
        demand), which its template prepares for while idle (their tokenizers)."""
        self.enabled = enabled and sys.platform.startswith("linux")
        self.wanted = policies if self.enabled else set()
        self.ahead = ahead or {}
        for spin_wait in self.wanted:
            running = self._templates.get(spin_wait)
            if self._template(spin_wait) is running:  # a new one prepares once ready
                self._background(self._prepare_ahead(running))
        self._retire_idle()

    async def fork(self, argv: list[str], cwd: str | None, spin_wait: bool) -> ForkedEngine | None:
        """The engine forked from the template of its wait policy; None when it must be exec'd
        (templates off, or the template unavailable: logged)."""
        if not self.enabled:
            return None
        template = self._template(spin_wait)
        if not await template.wait_ready(START_TIMEOUT_S):
            log.warning("engine template (%s) not ready (%s): starting the engine without it",
                        template.policy, template.state.value)  # fmt: skip
            return None
        try:
            engine = await template.fork(argv, cwd)
        except TemplateUnavailable as error:
            log.warning("engine template (%s) could not fork (%s): starting the engine without it",
                        template.policy, error)  # fmt: skip
            return None
        self._background(self._retire_after(engine))
        return engine

    def pss_bytes(self) -> int:
        """What the templates hold, for the memory budget: their PSS (the pages they share with
        their engines are split between them; the engines' own PSS carries the rest)."""
        return sum(t.pss_bytes() for t in self._templates.values())

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "wait_policy": t.policy,
                "state": t.state.value,
                "pid": t.proc.pid if t.proc and t.state is not TemplateState.GONE else None,
                "engines": len(t.engines),
                "pss_bytes": t.pss_bytes(),
            }
            for t in self._templates.values()
        ]

    async def stop(self) -> None:
        self.wanted = set()
        templates = [*self._templates.values(), *self._retiring]
        self._templates = {}
        await asyncio.gather(*(t.stop() for t in templates))
        for task in list(self._tasks):
            task.cancel()

    def _template(self, spin_wait: bool) -> EngineTemplate:
        """The template of that policy, started if there is none, or anew once
        ``RESTART_AFTER_S`` passed since the last one died (until then, the dead one)."""
        template = self._templates.get(spin_wait)
        if template is not None and (
            template.state is not TemplateState.GONE
            or time.monotonic() - template.gone_at < RESTART_AFTER_S
        ):
            return template
        output = self.logs.template(wait_policy(spin_wait))
        template = EngineTemplate(spin_wait, self.cwd, output, self.module)
        self._templates[spin_wait] = template
        template.start()
        self._background(self._prepare_ahead(template))
        return template

    async def _prepare_ahead(self, template: EngineTemplate) -> None:
        if await template.wait_ready(START_TIMEOUT_S):
            for argv in self.ahead.get(template.spin_wait, []):
                await template.prepare(argv, self.cwd)

    def _retire_idle(self) -> None:
        for spin_wait, template in list(self._templates.items()):
            if spin_wait not in self.wanted and not template.engines:
                del self._templates[spin_wait]
                self._retiring.add(template)
                self._background(self._retire(template))

    async def _retire(self, template: EngineTemplate) -> None:
        await template.stop()
        self._retiring.discard(template)

    async def _retire_after(self, engine: ForkedEngine) -> None:
        await engine.wait()
        self._retire_idle()

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
