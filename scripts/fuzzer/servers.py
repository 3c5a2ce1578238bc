"""The servers under fuzz: what the runner needs of one (``Server``), a server in a child process
(``ProcessServer``, which may be killed by PID and restarted), the engine's command line and the
gateway's fleet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from common.net import free_port
from common.processes import kill_process, stop_process
from scripts.fuzzer.logs import REPO, LogFile

MIB = 2**20


class Server(Protocol):
    name: str
    host: str
    port: int
    pid: int

    def new_errors(self) -> list[str]: ...
    def alive(self) -> bool: ...
    def settle(self) -> None: ...  # before its RSS is read: hand freed memory back to the OS
    def kill(self) -> None: ...
    async def restart(self) -> bool: ...


class ProcessServer:
    """A server in a child process this code started (and so may kill, by its PID), logging to a
    file; ``restart`` replaces it with a fresh one on a new free port. It runs in ``cwd`` (a
    checkout: with PYTHONPATH set to it, its code imports rather than this one's)."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        log_dir: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/ready",
        start_timeout_s: float = 180.0,
        cwd: Path = REPO,
    ) -> None:
        self.name = name
        self.host = "127.0.0.1"
        self.port = 0
        self.pid = 0
        self._command = command
        self._log_dir = log_dir
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._ready_path = ready_path
        self._start_timeout_s = start_timeout_s
        self._cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0
        self.log: LogFile | None = None
        self._earlier_errors: list[str] = []  # a replaced process's last log lines

    def start(self) -> ProcessServer:
        self.port = free_port()
        self._starts += 1
        path = self._log_dir / f"{self.name}-{self._starts}.log"
        with path.open("wb") as log:
            self._proc = subprocess.Popen(
                self._command(self.port),
                cwd=self._cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
            )
        self.pid = self._proc.pid
        self.log = LogFile(path)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        url = f"http://{self.host}:{self.port}{self._ready_path}"
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}: {self.tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"{self.name} not ready after {self._start_timeout_s} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        return self.log.path.read_text(errors="replace")[-chars:]

    def new_errors(self) -> list[str]:
        errors, self._earlier_errors = self._earlier_errors, []
        return errors + (self.log.new_errors() if self.log else [])

    def settle(self) -> None:
        """Nothing: a process of its own returns what it frees."""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self._proc is not None:
            kill_process(self._proc)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout_s)

    async def restart(self) -> bool:
        self.kill()
        self._earlier_errors = self.new_errors()  # read with the finding that caused this
        await asyncio.to_thread(self.start)
        return True


def engine_command(
    model: Path | str, name: str, flags: tuple[str, ...]
) -> Callable[[int], list[str]]:
    """``python -m engine`` on a tiny model, as ProcessServer starts it."""

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "engine", "--model", str(model), "--port", str(port),
            "--served-model-name", name, *flags,
        ]  # fmt: skip

    return command


GATEWAY_KEY_ENV = "FUZZ_CLIENT_KEY"
GATEWAY_ADMIN_ENV = "FUZZ_ADMIN_KEY"
GATEWAY_KEYS = {GATEWAY_KEY_ENV: "fuzz-client-key-7f3a", GATEWAY_ADMIN_ENV: "fuzz-admin-key-91c2"}


def gateway_document(upstream_url: str, dead_url: str) -> dict[str, Any]:
    """The fleet scripts/fuzzer/profile.py's gateway profile expects: m1 (alias default) on a
    working upstream, ``down`` on a port nothing listens on; one client key and an admin key (from
    GATEWAY_KEYS in the environment); client deadlines of 1 s, so that unfinished requests get
    their 408 within a short wait."""
    return {
        "gateway": {
            "health": {"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 1},
            "retries": {"attempts": 2, "backoff_ms": 5},
            "watch_config": False,
            "access_log": False,
            "clients": {"header_timeout_s": 1, "body_timeout_s": 1},
            "auth": {
                "admin_key_env": GATEWAY_ADMIN_ENV,
                "keys": [{"name": "fuzz", "key_env": GATEWAY_KEY_ENV}],
            },
        },
        "models": [
            {"name": "m1", "aliases": ["default"], "upstreams": [upstream_url]},
            {"name": "down", "upstreams": [dead_url]},
        ],
    }
