"""An engine process as the pool runs it: its command line, spawning it so that it dies with the
gateway, relaying its output into its log file (gateway/engines/logs.py), signalling it, telling
how it ended (a signal, or its own exit), and the engine endpoints the pool calls (``/ready``,
``/status``, ``/sleep``, ``/wake_up``). An engine is exec'd here (``spawn``) or forked by an
engine template (gateway/engines/template.py); the pool sees either through ``EngineProcess``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, Protocol

import aiohttp

from common.engine_args import EngineArgs
from gateway.config import ModelConfig
from gateway.engines.logs import EngineLog

ENGINE_LAUNCHER = (sys.executable, "-m", "engine")
CRASH_NOTICE_S = 0.5  # how long an engine's exit may take to show after its connections dropped

# Linux: engines must not outlive a gateway that dies without cleaning up (SIGKILL, OOM killer).
# A tiny exec wrapper asks the kernel to SIGKILL the child when its parent dies
# (prctl(PR_SET_PDEATHSIG), kept across exec), then becomes the engine in the same process. A
# wrapper rather than preexec_fn: that runs between fork and exec in a threaded parent, which is
# unsafe, and not every event loop supports it. The "parent" is the thread that forked: the event
# loop's, which lives as long as the gateway. The getppid() check covers a gateway that died
# before the prctl.
_PR_SET_PDEATHSIG = 1
_DIE_WITH_PARENT = f"""\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit("the gateway is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


class EngineProcess(Protocol):
    """What the pool uses of an engine's process: an asyncio subprocess (exec'd), or a
    ``ForkedEngine`` (forked by a template, which reports its exit)."""

    pid: int
    returncode: int | None  # None while it runs; -N: killed by signal N
    stdout: asyncio.StreamReader | None  # its stdout and stderr

    async def wait(self) -> int: ...


def die_with_gateway() -> list[str]:
    """The prefix that makes a command die with this process (empty where Linux's prctl is not)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())]


def engine_command(
    model: ModelConfig, port: int, launcher: tuple[str, ...] = ENGINE_LAUNCHER
) -> list[str]:
    args = EngineArgs(
        model=model.source or "",
        served_model_name=model.name,
        port=port,
        max_model_len=model.max_model_len,
        max_num_seqs=model.max_num_seqs,
        device=model.device,
        kv_cache_memory=model.kv_cache_memory,
        gpu_memory_fraction=model.gpu_memory_fraction,
        spin_wait=model.spin_wait,
        extra=model.engine_args,
    )
    return [*launcher, *args.argv()]


def spec_of(model: ModelConfig) -> tuple[str, ...]:
    """What makes two replicas interchangeable: the engine command without its port, and without
    ``--spin-wait``, which follows the fleet's size (decided per start): a replica count change
    must not replace the other replicas."""
    return tuple(engine_command(replace(model, spin_wait=False), 0, ()))


async def spawn(command: list[str], cwd: str | None) -> asyncio.subprocess.Process:
    """Starts ``command`` in its own session (our SIGINT is not theirs: we stop them in order),
    its output piped to `relay_output`."""
    return await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )


async def relay_output(proc: EngineProcess, output: EngineLog) -> None:
    """Copies the engine's output into its log, line by line; returns at the engine's end of
    output, the file closed."""
    assert proc.stdout is not None
    try:
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a line longer than the stream's limit: take what is there
                line = await proc.stdout.read(1 << 16)
            if not line:
                return
            output.write(line.decode(errors="replace").rstrip("\n"))
    finally:
        output.close()


def send_signal(proc: EngineProcess | None, sig: int = signal.SIGTERM) -> None:
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def has_exited(proc: EngineProcess | None) -> bool:
    """Whether the process is gone, including one dead but not yet reaped by the event loop (a
    zombie), or reaped by its template before the gateway heard of it: the moment after a
    kill -9, before its supervisor has heard of it."""
    if proc is None or proc.returncode is not None:
        return True
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # procfs without it: gone
    except (OSError, IndexError):
        return False  # no procfs: trust returncode


def exit_reason(returncode: int) -> str:
    """How a process ended, for logs and transitions: asyncio's returncode is ``-N`` for a
    process killed by signal N (WIFSIGNALED), its exit status otherwise."""
    if returncode >= 0:
        return f"exited with {returncode}"
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(-returncode).name}"
    return f"killed by signal {-returncode}"


async def exits_soon(proc: EngineProcess | None) -> bool:
    """Whether the process is gone within ``CRASH_NOTICE_S``: asked after a connection to it
    dropped, which comes a moment before its exit shows (the kernel closes its sockets first)."""
    deadline = time.monotonic() + CRASH_NOTICE_S
    while not has_exited(proc):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


class EngineClient:
    """The engine endpoints the pool uses, over one session with short timeouts."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def ready(self, url: str) -> bool:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.get(url + "/ready", timeout=aiohttp.ClientTimeout(2)) as resp:
                return resp.status == 200
        return False

    async def status(self, url: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """The engine's ``GET /status`` (its measured memory, its start-up stage), None when it
        does not answer."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(url + "/status", timeout=timeout) as resp:
                if resp.status == 200:
                    body = await resp.json()
                    return body if isinstance(body, dict) else None
        return None

    async def post(self, url: str, path: str, timeout_s: float) -> tuple[int, str]:
        """POSTs ``path`` (``/sleep?level=1``, ``/wake_up``); (status, body) — status 0 when the
        engine could not be reached."""
        try:
            async with self.session.post(
                url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, (await resp.text())[:500]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return 0, str(exc) or type(exc).__name__
