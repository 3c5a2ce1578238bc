"""Each engine's output in a file of its own, rotated by size, and its readers.

An engine's stdout and stderr (exec'd or forked: both write into a pipe the gateway reads,
gateway/engines/process.py) go line by line into its replica's ``EngineLog``:
``<folder>/models/<model>/replica-<index>.log`` (the model's name percent-encoded), the engine
templates' into ``<folder>/templates/<wait policy>.log``. The file belongs to the replica's slot,
not its process: a restarted replica writes on in the same file, after a marker line the pool
writes at each start and exit. The gateway's own log keeps one line per engine event instead of
the engines' chatter.

Rotation: when a line would take the live file past ``max_bytes``, ``.1`` becomes ``.2`` and so
on up to ``files - 1``, the live file becomes ``.1`` and a new one starts, so a replica's logs
never take more than ``files × max_bytes``. A reader following a log live (``GET /admin/logs
?follow=1``) gets each line from memory as it is written, so rotation neither loses nor repeats
a line for it; it holds at most ``FOLLOW_BUFFER_LINES`` lines not yet sent, and counts the ones
a slow reader missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from common.cache_dir import cache_root
from gateway.config.schema import EngineLogSettings

log = logging.getLogger("modelyard.pool")

FOLLOW_BUFFER_LINES = 1000  # lines a follower holds before it drops (and counts) new ones
TAIL_MAX_BYTES = 4 * 2**20  # the most a tail reads back, over the rotated files too
_READ_BLOCK = 1 << 16


def log_folder(settings: EngineLogSettings, host: str, port: int) -> Path:
    """``dir``, or by default one folder per gateway under the cache folder: two gateways on
    one host cannot listen on the same address at once, so they never share a file."""
    return Path(settings.dir) if settings.dir else cache_root() / "logs" / f"{host}-{port}"


class Follower:
    """A reader of one log, live: the lines written since it began following."""

    def __init__(self) -> None:
        self._lines: deque[str] = deque()
        self._wake = asyncio.Event()
        self.dropped = 0  # lines not kept because the reader was FOLLOW_BUFFER_LINES behind
        self.closed = False  # the gateway stops: no more lines will come

    def push(self, line: str) -> None:
        if len(self._lines) >= FOLLOW_BUFFER_LINES:
            self.dropped += 1
        else:
            self._lines.append(line)
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def next_lines(self, timeout_s: float) -> list[str]:
        """The lines written since the last call; waits up to ``timeout_s`` for one (then, or
        once closed, there may be none)."""
        if not self._lines and not self.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout_s)
        self._wake.clear()
        lines = list(self._lines)
        self._lines.clear()
        return lines


class EngineLog:
    """One log file with its rotated predecessors, and the readers following it."""

    def __init__(self, path: Path, max_bytes: int, files: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self.followers: set[Follower] = set()
        self._file: BinaryIO | None = None
        self._size = 0
        self._broken = False  # the last write failed (warned once, until one succeeds)

    def write(self, line: str) -> None:
        """Appends one line (without its newline), rotating first when it would not fit."""
        for follower in self.followers:
            follower.push(line)
        data = (line + "\n").encode("utf-8", "replace")
        try:
            if self._file is None:
                self._open()
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(data)  # unbuffered: a tail reads what was written
            self._size += len(data)
            self._broken = False
        except OSError as error:
            self.close()
            if not self._broken:
                log.warning("cannot write the engine log %s (%s): its lines go to its live "
                            "readers only", self.path, error)  # fmt: skip
            self._broken = True

    def close(self) -> None:
        """Closes the file (its engine's output ended); the next write opens it again."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines: from the live file and, where it holds fewer, the rotated
        ones, reading back at most ``TAIL_MAX_BYTES`` in all (older lines are then left out)."""
        if lines <= 0:
            return []
        pieces: list[bytes] = []  # newest first
        budget, wanted, whole = TAIL_MAX_BYTES, lines, True
        for index in range(self.files):
            try:
                data, whole = _read_back(self._numbered(index), wanted, budget)
            except FileNotFoundError:
                continue
            except OSError:
                break
            pieces.append(data)
            budget -= len(data)
            found = data.count(b"\n")
            if not whole or found >= wanted or budget <= 0:
                break
            wanted -= found
        text = b"".join(reversed(pieces)).decode("utf-8", "replace")
        found_lines = text.split("\n")[:-1]  # every line ends with a newline
        if not whole:
            found_lines = found_lines[1:]  # read from the middle of a line
        return found_lines[-lines:]

    def follow(self) -> Follower:
        follower = Follower()
        self.followers.add(follower)
        return follower

    def unfollow(self, follower: Follower) -> None:
        self.followers.discard(follower)

    def _numbered(self, index: int) -> Path:
        return self.path if index == 0 else self.path.with_name(f"{self.path.name}.{index}")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (kept open across writes)
        self._size = os.fstat(self._file.fileno()).st_size

    def _rotate(self) -> None:
        self.close()
        for index in range(self.files - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._numbered(index - 1), self._numbered(index))
        with contextlib.suppress(FileNotFoundError):  # files: 1 keeps no rotated copy
            self.path.unlink()
        self._open()


def _read_back(path: Path, lines: int, budget: int) -> tuple[bytes, bool]:
    """The end of ``path`` that holds its last ``lines`` lines (or somewhat more), at most
    ``budget`` bytes; and whether that is the whole file."""
    with open(path, "rb") as f:
        end = position = f.seek(0, os.SEEK_END)
        data = b""
        while position > 0 and data.count(b"\n") <= lines and end - position < budget:
            step = min(_READ_BLOCK, position, budget - (end - position))
            position -= step
            f.seek(position)
            data = f.read(step) + data
    return data, position == 0


class EngineLogs:
    """The gateway's engine logs in ``folder``: one ``EngineLog`` per replica slot (model and
    index) and per engine template, made at first use and kept (their followers with them)."""

    def __init__(self, settings: EngineLogSettings, folder: Path) -> None:
        self.settings = settings
        self.folder = folder
        self._logs: dict[Path, EngineLog] = {}

    def replica(self, model: str, index: int) -> EngineLog:
        return self._log(Path("models", quote(model, safe="@+"), f"replica-{index}.log"))

    def template(self, wait_policy: str) -> EngineLog:
        return self._log(Path("templates", f"{wait_policy}.log"))

    def end_following(self) -> None:
        """The gateway stops: every live reader's stream ends."""
        for engine_log in self._logs.values():
            for follower in engine_log.followers:
                follower.close()

    def _log(self, relative: Path) -> EngineLog:
        path = self.folder / relative
        if path not in self._logs:
            self._logs[path] = EngineLog(path, self.settings.max_bytes, self.settings.files)
        return self._logs[path]
