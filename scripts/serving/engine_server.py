"""``python -m engine`` started by the benchmark on a free loopback port, and stopped; and the
readiness wait every benchmark's servers share."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.net import free_port
from common.processes import stop_process

REPO = Path(__file__).resolve().parents[2]
# Often enough that spawn-to-ready times of a one-second llama-server and a ten-second engine
# compare (bench_peers reports both).
READY_POLL_S = 0.1


def wait_ready(proc: subprocess.Popen, url: str, what: str, timeout: float) -> None:
    """Until ``url`` answers 200; RuntimeError naming the exit code (and signal) if ``proc``
    exits first, TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            code = proc.returncode
            signal_name = f" ({signal.Signals(-code).name})" if code < 0 else ""
            raise RuntimeError(f"{what} exited with code {code}{signal_name}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while it loads
        time.sleep(READY_POLL_S)
    raise TimeoutError(f"{what} not ready after {timeout} s")


class EngineServer:
    """``python -m engine`` with the given flags on a free loopback port."""

    def __init__(self, engine_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the process lifetime)
        cmd = [
            sys.executable,
            "-m",
            "engine",
            *engine_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        """/ready answers 200 once the model is loaded."""
        wait_ready(self.proc, self.url + "/ready", "engine", timeout)

    def stop(self) -> int | None:
        stop_process(self.proc, 60)
        self._log.close()
        return self.proc.returncode
