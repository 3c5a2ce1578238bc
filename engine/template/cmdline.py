"""A forked engine's command line as ps and /proc/PID/cmdline show it: the engine's own
``python -m engine ...`` rather than its template's, so that operators and scripts that look for
an engine by its command line find it.

The kernel shows a process's argument area, which the template reserved room in
(``--cmdline-room``, common/template_wire.py); the child overwrites it in place, NUL-separated and
NUL-padded (the kernel then shows the whole area, as it does for an untouched one). Linux only;
elsewhere, or if the area cannot be found, the template's command line stays.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence

# /proc/PID/stat fields after "pid (comm)": the argument area's start and end are fields 48, 49
_ARG_START, _ARG_END = 45, 46


def _argument_area() -> tuple[int, int] | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[_ARG_START]), int(fields[_ARG_END])
        if 0 < start < end:
            return start, end
    return None


def fit(argv: Sequence[str], room: int) -> bytes:
    """``argv`` NUL-separated, as many whole arguments as fit in ``room`` bytes with a NUL at the
    end, padded with NULs to ``room``."""
    data = b""
    for arg in argv:
        encoded = arg.encode(errors="replace") + b"\0"
        if len(data) + len(encoded) > room:
            break
        data += encoded
    return data.ljust(room, b"\0")


def set_cmdline(argv: Sequence[str]) -> bool:
    """Shows ``argv`` as this process's command line; False where it could not."""
    area = _argument_area()
    if area is None:
        return False
    start, end = area
    ctypes.memmove(start, fit(argv, end - start), end - start)
    return True
