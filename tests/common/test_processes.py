"""common/processes.py against real processes: this one, a child holding memory under a parent,
a zombie, and children that stop on SIGTERM or only on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common import processes

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's"),
]

HOLD_64MIB = "b = bytearray(64 << 20); import time; time.sleep(30)"
IGNORE_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
)


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def test_this_process() -> None:
    rss, peak = processes.rss_bytes(), processes.peak_rss_bytes()
    assert rss is not None and peak is not None and 0 < rss <= peak
    assert processes.rss_bytes(os.getpid()) == pytest.approx(rss, rel=0.5)
    assert processes.alive(os.getpid())
    assert "python" in processes.cmdline(os.getpid())[0]
    assert processes.cpu_seconds(os.getpid()) > 0
    assert processes.open_fds(os.getpid()) >= 3
    assert processes.fd_limit(os.getpid()) is not None


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    child = _child("pass")
    child.wait(10)
    pid = child.pid
    assert processes.rss_bytes(pid) is None and processes.peak_rss_bytes(pid) is None
    assert not processes.alive(pid) and processes.cmdline(pid) == []
    assert processes.cpu_seconds(pid) is None and processes.open_fds(pid) is None


def test_a_zombie_is_not_alive() -> None:
    child = _child("pass")
    _until(lambda: not processes.alive(child.pid))  # exited, not yet reaped
    assert child.poll() is not None


def test_tree_rss_counts_descendants() -> None:
    """A child holding 64 MiB under a parent: the parent's tree RSS includes it."""
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {HOLD_64MIB!r}]); time.sleep(30)"
    )
    parent = _child(code)
    try:
        _until(lambda: processes.descendants(parent.pid))
        [grandchild] = processes.descendants(parent.pid)
        assert processes.children(parent.pid) == [grandchild]
        _until(lambda: (processes.rss_bytes(grandchild) or 0) > 64 << 20)
        own = processes.rss_bytes(parent.pid) or 0
        assert (processes.TreeRss().rss_bytes(parent.pid) or 0) - own > 64 << 20
    finally:
        for pid in processes.descendants(parent.pid):  # the child this test's parent started
            os.kill(pid, signal.SIGKILL)
        processes.kill_process(parent)


def test_stop_process_terminates_then_kills() -> None:
    polite = _child("import time; time.sleep(30)")
    _until(lambda: processes.alive(polite.pid))
    assert processes.stop_process(polite, 10) is False
    assert polite.returncode == -signal.SIGTERM
    stubborn = _child(IGNORE_SIGTERM)
    time.sleep(0.5)  # its handler is set
    assert processes.stop_process(stubborn, 0.5) is True
    assert stubborn.returncode == -signal.SIGKILL
    assert processes.stop_process(stubborn, 0.5) is False  # already gone: nothing to do
