"""The template's loop: fork an engine per request from the gateway, reap the engines (it is their
parent, so only it can read how they ended) and report both, over the socket the gateway handed
it (common/template_wire.py). One thread, no event loop: a SIGCHLD wakes the poll through a
pipe (``signal.set_wakeup_fd``). It exits when the gateway closes its end; engines still running
then die with it (their parent-death signal)."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from common.template_wire import (
    EXITED,
    FORK,
    FORKED,
    PREPARE,
    READY,
    WireError,
    decode,
    encode,
    receive,
)
from common.template_wire import send as send_packet
from engine.template.child import become_engine
from engine.template.preload import Preloaded, thread_problem

if TYPE_CHECKING:  # it imports the engine's loader: a template has it preloaded, a test's not
    from engine.template.tokenizers import TokenizerShelf


class TemplateServer:
    """``tokenizers``: where the engines' tokenizers are built before they fork (None: each
    engine builds its own)."""

    def __init__(
        self, socket_fd: int, preloaded: Preloaded, tokenizers: TokenizerShelf | None = None
    ) -> None:
        self.sock = socket.socket(fileno=socket_fd)
        self.sock.setblocking(True)
        self.preloaded = preloaded
        self.engines: set[int] = set()  # forked, not yet reaped
        self.tokenizers = tokenizers
        # engines to prepare for (argv, cwd), once no message waits: a fork is never held up
        self.ahead: collections.deque[tuple[list[str], str | None]] = collections.deque()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def run(self) -> int:
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, for the wakeup fd to be written
        signal.set_wakeup_fd(self._wake_write)
        if self.preloaded.missing:
            missing = ", ".join(self.preloaded.missing)
            say(f"not preloaded (an engine imports them itself): {missing}")
        say(f"{self.preloaded.module_count} modules imported in {self.preloaded.seconds:.2f}s")
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        try:
            self._send(READY, pid=os.getpid(), imports_s=round(self.preloaded.seconds, 3))
            while True:
                events = poller.poll(0 if self.ahead else None)
                if not events:
                    self._prepare_one()
                for fd, _ in events:
                    if fd == self._wake_read:
                        self._drain_wakeups()
                        self._reap()
                    elif not self._serve_one():
                        return 0
        except (BrokenPipeError, ConnectionError):
            return 0  # the gateway is gone: so are we (and our engines, by their death signal)

    def _serve_one(self) -> bool:
        """Handles one message; False once the gateway has closed its end."""
        try:
            data, fds = receive(self.sock, max_fds=1)
        except WireError as error:
            say(f"dropped a message: {error}")
            return True
        if not data:
            return False
        try:
            message = decode(data)
        except WireError as error:
            _close(fds)
            say(f"dropped a message: {error}")
            return True
        if message["kind"] == FORK:
            self._fork(message, fds)
        elif message["kind"] == PREPARE:
            _close(fds)
            argv, cwd = message.get("argv"), message.get("cwd")
            problem = _engine_problem(argv, cwd)
            if problem:
                say(f"dropped a prepare message: {problem}")
            else:
                self.ahead.append((argv, cwd))
        else:
            _close(fds)
            say(f"dropped a message of unknown kind {message['kind']!r}")
        return True

    def _fork(self, message: dict[str, Any], fds: list[int]) -> None:
        request = message.get("id")
        argv, cwd = message.get("argv"), message.get("cwd")
        tokenizer = None
        problem = _engine_problem(argv, cwd)
        if len(fds) != 1:
            problem = "a fork request carries the engine's output descriptor"
        elif problem is None:
            if self.tokenizers is not None:
                tokenizer, line = self.tokenizers.prepare(argv, cwd)
                if line:
                    say(line)
            problem = thread_problem()  # fork copies one thread: the others' locks stay held
        if problem:
            _close(fds)
            self._send(FORKED, id=request, error=problem)
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # else the child writes the template's buffered lines again
        template = os.getpid()
        try:
            pid = os.fork()
        except OSError as error:
            _close(fds)
            self._send(FORKED, id=request, error=f"fork failed: {error}")
            return
        if pid == 0:
            inherited = [self.sock.fileno(), self._wake_read, self._wake_write]
            become_engine(argv, cwd, fds[0], inherited, parent=template)
        _close(fds)
        self.engines.add(pid)
        if self.tokenizers is not None:
            self.tokenizers.forked(pid, tokenizer)
        self._send(FORKED, id=request, pid=pid)

    def _prepare_one(self) -> None:
        """Builds the tokenizer of the next engine the gateway may fork (engine.template.
        tokenizers: while the unused ones stay within their bound)."""
        argv, cwd = self.ahead.popleft()
        if self.tokenizers is not None:
            line = self.tokenizers.prepare_ahead(argv, cwd)
            if line:
                say(line)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.engines.discard(pid)
            self._send(EXITED, pid=pid, status=status)
            for line in self.tokenizers.exited(pid) if self.tokenizers is not None else ():
                say(line)

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 512):
                pass

    def _send(self, kind: str, **fields: Any) -> None:
        send_packet(self.sock, encode(kind, **fields))


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def say(text: str) -> None:
    """A line of the template's own on its stderr (the gateway relays it); not through logging,
    whose root handlers every forked engine would inherit and then not configure its own."""
    print(f"engine template {os.getpid()}: {text}", file=sys.stderr, flush=True)


def _engine_problem(argv: object, cwd: object) -> str | None:
    """What is wrong with an engine's flags and working directory as a message carries them."""
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return "argv must be a list of strings"
    if cwd is not None and not isinstance(cwd, str):
        return "cwd must be a string"
    return None
