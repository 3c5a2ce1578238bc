"""A server's errors as one line each (a traceback's innermost frame in this repository and its
exception): read from a process's log file, or captured from this process's logging."""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_REPO_PREFIX = str(REPO) + "/"


def tracebacks_in(text: str) -> list[str]:
    """Each traceback in ``text`` as one line: the innermost frame in this repository (else the
    innermost frame) and the exception, e.g. ``engine/serving/requests.py:163 in parse_messages:
    TypeError: unhashable type: 'list'``."""
    found: list[str] = []
    frames: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            inside, frames = True, []
        elif inside and (match := _FRAME.search(line)):
            file = match["file"].removeprefix(_REPO_PREFIX)
            frames.append(f"{file}:{match['line']} in {match['func']}")
        elif inside and line and not line.startswith((" ", "\t")):
            ours = [f for f in frames if not f.startswith("/")]
            where = (ours or frames or ["?"])[-1]
            found.append(f"{where}: {line.strip()[:160]}")
            inside = line.startswith(("During handling", "The above exception"))
    return found


class LogFile:
    """A server's log file, read from where the last call stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_errors(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
            # Up to the last complete line: a traceback still being written is read next time.
            end = data.rfind(b"\n") + 1
            self.offset += end
            text = data[:end].decode("utf-8", "replace")
            errors = tracebacks_in(text)
            plain = [
                line.strip()[:200]
                for line in text.splitlines()
                if " ERROR " in line and "Traceback" not in line
            ]
            return errors or plain
        return []


class LogCapture(logging.Handler):
    """ERROR records of an in-process server, as LogFile gives them for a process."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            text = "".join(traceback.format_exception(*record.exc_info))
            self.lines += tracebacks_in("Traceback (most recent call last):\n" + text)
        else:
            self.lines.append(record.getMessage()[:200])

    def new_errors(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines
