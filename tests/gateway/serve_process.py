"""``modelyard serve`` as a real process for tests, and the /proc look-ups that find its engines."""

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
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE = shlex.join([sys.executable, str(Path(__file__).with_name("fake_engine.py"))])


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
    may edit); ``stop`` ends it and, as a safety net for a failed test, any engine it left behind
    (only processes this gateway started). Its stderr goes to a file (``stderr()``), and its stdout,
    the access log, to ``access_log`` when given."""

    def __init__(
        self,
        document: dict[str, Any],
        tmp_path: Path,
        port: int,
        engine_command: str | None = None,
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
        log_level: str = "warning",
        access_log: Path | None = None,
    ) -> None:
        self.admin_key = admin_key
        self.config = tmp_path / "models.yaml"
        self.config.write_text(yaml.safe_dump(document))
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(self.config)]
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}: {self.stderr()}")
            with contextlib.suppress(OSError):
                if http_get(self.url + "/ready", timeout=0.5)[0] == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"gateway not serving in {timeout}s: {self.stderr()}")

    def wait_ready(self, replicas: int, timeout: float) -> None:
        """Until ``replicas`` engines run under this gateway and all of them take traffic."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}: {self.stderr()}")
            self.engine_pids |= children_of(self.proc.pid)
            with contextlib.suppress(OSError):
                status, state = http_get(self.url + "/admin/backends", token=self.admin_key)
                if status == 200 and len(self.engine_pids) >= replicas:
                    backends = [b for m in state["models"] for b in m["backends"]]
                    if sum(b["available"] for b in backends) >= replicas:
                        return
            time.sleep(0.1)
        raise AssertionError(f"gateway not ready in {timeout}s: {self.stderr()}")

    def stderr(self, tail: int | None = 4000) -> str:
        """The last ``tail`` characters of the gateway's stderr (None: all of it)."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.engine_pids:
            if running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.log.close()


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields after "pid (comm) ", comm may hold spaces


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == pid:
                found.add(int(entry))
    return found


def running(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's zombie waits on whoever reaps orphans here)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")
