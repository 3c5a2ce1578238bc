"""A forked child becoming the engine: what an exec'd ``python -m engine`` gets from its parent
and its launcher, done by hand. Its own session (the gateway stops its engines in order, and a
terminal's Ctrl-C is not theirs), death with the template (SIGKILL when its parent dies, as the
gateway's exec wrapper asks for its engines: the template itself dies with the gateway), the
signal handlers Python starts with, the engine's output on the pipe the gateway reads, its
working directory and command line; then the engine's CLI, and ``os._exit`` with its status: it
never returns into the template's loop."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

from engine import startup
from engine.template.cmdline import set_cmdline

_PR_SET_PDEATHSIG = 1
ENGINE_MAIN = ("-m", "engine")


def become_engine(
    argv: list[str], cwd: str | None, output_fd: int, inherited: Sequence[int], parent: int
) -> NoReturn:
    """In the child, right after the fork: ``argv`` are the `python -m engine` flags,
    ``output_fd`` its stdout and stderr, ``inherited`` the template's descriptors to close,
    ``parent`` the template's pid."""
    forked_at = time.monotonic()
    code = 1
    try:
        os.setsid()
        _die_with(parent)
        _reset_signals()
        _redirect(output_fd)
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        if cwd:
            os.chdir(cwd)
        sys.argv = [sys.executable, *ENGINE_MAIN, *argv]
        set_cmdline(sys.argv)
        # The engine's start-up clock starts at the fork: what it logs as "imports and http
        # server" is then only its server's start.
        startup.mark_process_start(forked_at)
        code = _run_engine(argv)
    except BaseException:  # whatever happens, never back into the template
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _die_with(parent: int) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the prctl: no signal will come
        os._exit(1)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _redirect(output_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to ``output_fd`` (Python's sys.stdout and
    sys.stderr write to descriptors 1 and 2, so they follow)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)


def _run_engine(argv: list[str]) -> int:
    """The engine's CLI, then the interpreter's exit handlers (logging's flush ...), as a
    ``python -m engine`` that returns from main runs them; its exit status."""
    from engine.serving.cli import main

    try:
        code = _status(main(argv))
    except SystemExit as exit_:
        code = _status(exit_.code)
    except BaseException:  # reported as Python reports it, exit status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def _status(code: object) -> int:
    """What ``sys.exit(code)`` would exit with (a message is printed, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
