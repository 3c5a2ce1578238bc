"""The access log: one JSON object per line, written in batches.

Lines are buffered and flushed within ``FLUSH_S`` (and at shutdown), so the hot path pays for one
``json.dumps`` and a list append instead of a logging record, formatter and write per request.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, TextIO

FLUSH_S = 0.1
MAX_BUFFERED = 1000  # lines; beyond this, flush at once


class AccessLog:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self._lines: list[str] = []
        self._flush_handle: asyncio.TimerHandle | None = None

    def write(self, entry: dict[str, Any]) -> None:
        self._lines.append(json.dumps(entry, separators=(",", ":")))
        if len(self._lines) >= MAX_BUFFERED:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stdout must not take requests down
