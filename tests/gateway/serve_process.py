"""``modelyard serve`` as a real process for tests (its engines found through /proc)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from common.processes import alive, children, stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE = shlex.join([sys.executable, str(Path(__file__).with_name("fake_engine.py"))])


def with_engine_logs(document: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``document`` with its engines' log files in ``folder`` (the test's own, rather than one
    under the user's cache folder), unless it names a folder itself."""
    gateway = dict(document.get("gateway") or {})
    gateway.setdefault("engine_logs", {"dir": str(folder)})
    return {**document, "gateway": gateway}


def http_get(url: str, timeout: float = 2.0, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


class ServeProcess:
    """A gateway process started from a models.yaml document (written to ``config``, which tests
    may edit), or with ``models_args`` (models from the command line) in its place; ``stop`` ends
    it and, as a safety net for a failed test, any engine it left behind (only processes this
    gateway started). Its stderr goes to a file (``stderr()``), and its stdout, the access log, to
    ``access_log`` when given."""

    def __init__(
        self,
        document: dict[str, Any] | None,
        tmp_path: Path,
        port: int,
        engine_command: str | None = None,
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
        log_level: str = "warning",
        access_log: Path | None = None,
        models_args: list[str] | None = None,
    ) -> None:
        self.admin_key = admin_key
        self.config = tmp_path / "models.yaml"
        if document is not None:
            document = with_engine_logs(document, tmp_path / "engines")
            self.config.write_text(yaml.safe_dump(document))
            models_args = ["-c", str(self.config)]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gateway.cli", "serve", *(models_args or [])]
        command += ["--port", str(port), "--log-level", log_level]
        if engine_command:
            command += ["--engine-command", engine_command]
        # Files, not pipes: a full pipe would block the gateway's logging.
        self.log = (tmp_path / "gateway.log").open("wb")
        with open(access_log or os.devnull, "wb") as stdout:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdout=stdout,
                stderr=self.log,
                env={**os.environ, **(env or {})},
            )
        self.engine_pids: set[int] = set()

    def wait_serving(self, timeout: float = 15.0) -> None:
        """Until /ready answers 200 (some model has a backend that takes traffic)."""
        self._wait_until(
            lambda: http_get(self.url + "/ready", timeout=0.5)[0] == 200, timeout, 0.05, "serving"
        )

    def wait_ready(self, replicas: int, timeout: float) -> None:
        """Until ``replicas`` engines run under this gateway and all of them take traffic."""

        def ready() -> bool:
            self.engine_pids |= set(children(self.proc.pid))
            status, state = http_get(self.url + "/admin/backends", token=self.admin_key)
            if status != 200 or len(self.engine_pids) < replicas:
                return False
            backends = [b for m in state["models"] for b in m["backends"]]
            return sum(b["available"] for b in backends) >= replicas

        self._wait_until(ready, timeout, 0.1, "ready")

    def wait_available(self, backends: int, timeout: float) -> None:
        """Until ``backends`` backends take traffic, whoever started their engines (the gateway
        or its engine template)."""

        def available() -> bool:
            status, state = http_get(self.url + "/admin/backends", token=self.admin_key)
            found = sum(b["available"] for m in state["models"] for b in m["backends"])
            return status == 200 and found >= backends

        self._wait_until(available, timeout, 0.1, "ready")

    def _wait_until(
        self, done: Callable[[], bool], timeout: float, interval: float, what: str
    ) -> None:
        """Poll ``done`` (a connection error counts as not yet) until it holds; fails at once if
        the gateway exits, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}: {self.stderr()}")
            with contextlib.suppress(OSError):
                if done():
                    return
            time.sleep(interval)
        raise AssertionError(f"gateway not {what} in {timeout}s: {self.stderr()}")

    def stderr(self, tail: int | None = 4000) -> str:
        """The last ``tail`` characters of the gateway's stderr (None: all of it)."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> None:
        stop_process(self.proc, 15)
        for pid in self.engine_pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.log.close()
