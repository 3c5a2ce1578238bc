"""A server that tests and benchmarks run as a child process (the mock upstream, redis-server):
waited for until it answers, killed like a crash, or stopped."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

from common.processes import kill_process, stop_process


class ChildServer:
    what = "server"  # for errors
    proc: subprocess.Popen[bytes] | None = None

    def wait_answering(self, answers: Callable[[], bool], timeout: float, poll_s: float) -> None:
        """Until ``answers()`` (a connection error counts as not yet); raises if the process
        exits first, or after ``timeout``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}")
            try:
                if answers():
                    return
            except OSError:
                pass
            time.sleep(poll_s)
        raise RuntimeError(f"{self.what} did not answer within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to its clients."""
        if self.proc:
            kill_process(self.proc)

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 5)
