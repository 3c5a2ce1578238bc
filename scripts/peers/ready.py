"""Waiting for a server process to answer 200 on its readiness URL, polled often enough (0.1 s)
that spawn-to-ready times of a one-second llama-server and a ten-second engine compare; and the
engine server whose wait uses it."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request

from scripts.serving.engine_server import EngineServer

POLL_S = 0.1


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
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} not ready after {timeout} s")


class TimedEngineServer(EngineServer):
    """``python -m engine`` whose readiness (/ready: the model loaded) is polled every POLL_S."""

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.proc, self.url + "/ready", "engine", timeout)
