"""What /proc says about the processes under attack: liveness, command lines, children (to find
the gateway's engine), VmRSS (of one process or with its descendants: an engine may run
workers), CPU time, open files and their limit; and this process's own file limit."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def proc_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def proc_cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Children, grandchildren ... of ``pid`` (one /proc scan; bounded by the process count)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += parents.get(child, [])
    return found


def find_engine_pid(gateway_pid: int, port: int) -> int | None:
    """The engine listening on ``port``: a descendant of the gateway (its launcher execs it)."""
    todo = children(gateway_pid)
    for _ in range(1000):  # bounded walk of the process tree
        if not todo:
            return None
        pid = todo.pop()
        cmd = proc_cmdline(pid)
        if "engine" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return pid
        todo += children(pid)
    return None


def vm_rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


class TreeRss:
    """VmRSS of a process with all its descendants (pages they share count once per process),
    sampled often: the /proc scan that finds the descendants (ms) runs at most every RESCAN_S,
    their VmRSS at every call."""

    RESCAN_S = 0.5

    def __init__(self) -> None:
        self._pid: int | None = None
        self._children: list[int] = []
        self._scanned = 0.0

    def kb(self, pid: int) -> int | None:
        own = vm_rss_kb(pid)
        if own is None:
            return None
        if pid != self._pid or time.monotonic() - self._scanned > self.RESCAN_S:
            self._pid, self._children, self._scanned = pid, descendants(pid), time.monotonic()
        return own + sum(vm_rss_kb(child) or 0 for child in self._children)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` so far (its threads included, reaped children too)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        return ticks / os.sysconf("SC_CLK_TCK")
    return None


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def fd_limit(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return None
