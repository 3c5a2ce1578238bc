"""Helpers for the engine server tests: an in-process app on a free port, and a real
``python -m engine`` subprocess (what the gateway's pool runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from common.http_server import ClientLimits
from common.net import free_port
from common.processes import kill_process, stop_process
from engine.serving.app import ServerSettings, create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.server import EngineRunner

REPO_ROOT = Path(__file__).resolve().parent.parent


class InProcessServer:
    """AsyncEngine + app served on 127.0.0.1 in the test's own event loop, by the runner that
    ``python -m engine`` uses."""

    def __init__(
        self,
        core_factory: Callable,
        names: list[str],
        max_queue: int = 64,
        max_body_bytes: int = 4 * 2**20,
        client_limits: ClientLimits | None = None,
    ) -> None:
        self.engine = AsyncEngine(core_factory, names[0], max_queue=max_queue)
        settings = ServerSettings(
            names, max_body_bytes, client_limits=client_limits or ClientLimits()
        )
        self.app = create_app(self.engine, settings)
        self.runner = EngineRunner(self.app, handler_cancellation=True, shutdown_timeout=2.0)
        self.url = ""

    async def start(self, wait_loaded: bool = True) -> InProcessServer:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self.engine.start()
        if wait_loaded:
            await self.engine.wait_loaded()
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


class EngineProcess:
    """``python -m engine`` on a free port; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        model: Path | str,
        *extra: str,
        names: tuple[str, ...] = ("tiny",),
        launcher: tuple[str, ...] = (sys.executable, "-m", "engine"),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"engine-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (kept open for the process lifetime)
        cmd = [
            *launcher,
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            *names,
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def wait_ready(self, timeout: float = 180.0) -> EngineProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"engine not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60.0) -> int:
        stop_process(self.proc, timeout)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        kill_process(self.proc)
