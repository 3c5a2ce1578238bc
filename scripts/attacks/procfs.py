"""What /proc says about the processes under attack: liveness, command lines, children (to find
the gateway's engine), VmRSS, open files and their limit; and this process's own file limit."""

from __future__ import annotations

import contextlib
import os
import resource
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
