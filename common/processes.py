"""Processes as Linux's /proc shows them (another one, or this one with ``pid=None``), and
stopping a child: for the engine (its /status, its compile workers), the scripts and the tests.
A reader answers None (or nothing) for a process that is gone or where there is no /proc."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
KILL_WAIT_S = 10.0  # a SIGKILLed process is gone within this (unless stuck in the kernel)


def _proc(pid: int | None) -> Path:
    return Path("/proc") / ("self" if pid is None else str(pid))


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after ``pid (comm)`` (comm may hold spaces and parentheses):
    [0] state, [1] parent, [11:15] utime, stime, cutime, cstime."""
    with contextlib.suppress(OSError, IndexError):
        return _proc(pid).joinpath("stat").read_text().rsplit(")", 1)[1].split()
    return None


def _status_kib(pid: int | None, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in _proc(pid).joinpath("status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident set size now (VmRSS, from /proc/PID/statm)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(_proc(pid).joinpath("statm").read_text().split()[1]) * PAGE_SIZE
    return None


def pss_bytes(pid: int | None = None) -> int | None:
    """Proportional set size (smaps_rollup's Pss): each shared page counted once over all the
    processes that map it, so the PSS of processes that share pages (engines forked from one
    parent, a mapped model file) adds up to what they hold together."""
    with contextlib.suppress(OSError, ValueError):
        for line in _proc(pid).joinpath("smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return None


def mapping_bytes(address: int, field: str, pid: int | None = None) -> int | None:
    """``field`` (Rss, Pss, ...) of the mapping that starts at ``address`` (/proc/PID/smaps), in
    bytes; None where no mapping starts there. Reads the whole smaps: for occasional calls."""
    start = f"{address:x}-"
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = _proc(pid).joinpath("smaps").read_text().splitlines()
        for at, line in enumerate(lines):
            if line.startswith(start):
                for row in lines[at + 1 :]:
                    if row.startswith(f"{field}:"):
                        return int(row.split()[1]) * 1024
                    if "-" in row.split(maxsplit=1)[0]:  # the next mapping's header
                        break
                return None
    return None


def peak_rss_bytes(pid: int | None = None) -> int | None:
    """The largest resident set size so far (VmHWM)."""
    kib = _status_kib(pid, "VmHWM")
    return kib * 1024 if kib is not None else None


def alive(pid: int) -> bool:
    """It exists and has not exited: a zombie (dead, not yet reaped) is not alive."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return _proc(pid).joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def _parents() -> dict[int, list[int]]:
    """Every process's children, by parent (one scan of /proc)."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            found.setdefault(int(fields[1]), []).append(int(entry.name))
    return found


def children(pid: int) -> list[int]:
    return _parents().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Children, grandchildren ... of ``pid``."""
    parents = _parents()
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += parents.get(child, [])
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time so far: its threads, and its children that it has reaped."""
    fields = _stat(pid)
    if not fields:
        return None
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(_proc(pid) / "fd"))
    return None


def fd_limit(pid: int) -> int | None:
    """Its soft open-file limit."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in _proc(pid).joinpath("limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return None


class TreeRss:
    """The resident set of a process with all its descendants (an engine runs workers; pages
    they share count once per process), for sampling often: the /proc scan that finds the
    descendants (milliseconds) runs at most every RESCAN_S, their RSS is read at every call."""

    RESCAN_S = 0.5

    def __init__(self) -> None:
        self._pid: int | None = None
        self._descendants: list[int] = []
        self._scanned = 0.0

    def rss_bytes(self, pid: int) -> int | None:
        own = rss_bytes(pid)
        if own is None:
            return None
        if pid != self._pid or time.monotonic() - self._scanned > self.RESCAN_S:
            self._pid, self._descendants = pid, descendants(pid)
            self._scanned = time.monotonic()
        return own + sum(rss_bytes(child) or 0 for child in self._descendants)


def kill_process(proc: subprocess.Popen) -> None:
    """SIGKILL, and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(KILL_WAIT_S)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGTERM (a server drains and exits), SIGKILL if it is still there after ``timeout_s``;
    returns whether it took the SIGKILL. Either way it is reaped: ``proc.returncode`` is set."""
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_process(proc)
        return True
    return False
