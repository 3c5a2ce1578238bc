"""Reloading models.yaml when it changes on disk.

Polls the file's mtime and size: cheap, portable, and no extra dependency. Reloads once a change
has held for a whole poll interval, so a file an editor writes in pieces is read once, complete,
rather than half-written (and refused).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

CONFIG_POLL_S = 1.0

Stamp = tuple[int, int]  # mtime in ns, size


def file_stamp(path: str | None) -> Stamp | None:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class ConfigWatcher:
    """Knows the file as last read; ``run`` reloads whenever it has changed since."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.read_stamp = file_stamp(path)

    def mark_read(self) -> None:
        """Called when the file is (re)loaded, from here or elsewhere (SIGHUP, /admin/reload), so
        that a reload of the current file is not repeated."""
        self.read_stamp = file_stamp(self.path)

    async def run(self, reload: Callable[[], Awaitable[object]]) -> None:
        settling: Stamp | None = None  # a changed stamp, not yet seen twice in a row
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            stamp = file_stamp(self.path)
            if stamp is None or stamp == self.read_stamp:
                settling = None
            elif stamp != settling:
                settling = stamp
            else:
                settling = None
                await reload()
