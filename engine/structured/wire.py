"""Messages between the engine and its grammar-compile workers: JSON objects, each after its
length as 4 big-endian bytes, over the worker's stdin and stdout pipes. The worker's side blocks
(`read_message`, `write_message`); the engine's reads through `FrameReader` with a deadline, so
that a worker that hangs or dies never blocks the engine."""

from __future__ import annotations

import json
import os
import select
import struct
import time
from collections.abc import Callable
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
POLL_S = 0.05  # how often a waiting reader looks at its cancel flag


def encode(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, ensure_ascii=False).encode()
    return _HEADER.pack(len(payload)) + payload


def write_message(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(encode(message))
    stream.flush()


def read_message(stream: BinaryIO) -> dict[str, Any] | None:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return json.loads(payload)


class ReadTimeout(Exception):
    """No whole message arrived before the deadline."""


class ReadCancelled(Exception):
    """The reader's cancel check said stop."""


class FrameReader:
    """Reads messages from a pipe's file descriptor without blocking past a deadline."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()

    def read(self, deadline: float, cancelled: Callable[[], bool]) -> dict[str, Any] | None:
        """The next message; None at end of file (the worker exited). ReadTimeout once
        `deadline` (time.monotonic()) passes, ReadCancelled as soon as `cancelled()`."""
        while True:
            message = self._take()
            if message is not None:
                return message
            if cancelled():
                raise ReadCancelled
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReadTimeout
            readable, _, _ = select.select([self._fd], [], [], min(left, POLL_S))
            if readable:
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    return None
                self._buffer += chunk

    def _take(self) -> dict[str, Any] | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        end = _HEADER.size + size
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        return json.loads(payload)
