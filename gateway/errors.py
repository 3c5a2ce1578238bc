"""The gateway's one error of its own making: the SSE event that ends a started stream. Every
other error answer is common/errors.py's."""

from __future__ import annotations

from common.errors import error_body


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream which cannot be completed after it started."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
