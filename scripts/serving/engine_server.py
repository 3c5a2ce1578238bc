"""``python -m engine`` started by the benchmark on a free loopback port, and stopped."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.net import free_port
from common.processes import stop_process

REPO = Path(__file__).resolve().parents[2]


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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine not ready after {timeout} s")

    def stop(self) -> int | None:
        stop_process(self.proc, 60)
        self._log.close()
        return self.proc.returncode
