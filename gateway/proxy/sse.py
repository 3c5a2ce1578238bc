"""Server-sent events: the relay that passes an upstream's events to the client, and the error
event that ends a stream which cannot be completed after it started."""

from __future__ import annotations

import json

from common.errors import error_body
from gateway.proxy.exchange import Exchange
from gateway.proxy.model_names import Rename, rename_model


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The gateway's one error of its own shape: every other error answer is common/errors.py's."""
    return b"data: " + error_body(status, message, code) + b"\n\n"


def _events_end(data: bytes) -> int:
    """Offset just past the last complete SSE event in ``data`` (0 if none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class SseRelay:
    """Cuts the upstream byte stream at event boundaries and passes events through unchanged,
    except that it reads usage, drops the usage-only event a client did not ask for, and maps the
    upstream's model name back to the served one. Each event is charged to the request's tenant
    as one generated token as it passes (fair queuing: gateway/admission); the usage at the end
    corrects the count."""

    __slots__ = ("done", "ex", "pending", "rename", "strip_usage")

    def __init__(self, ex: Exchange, strip_usage: bool, rename: Rename | None) -> None:
        self.ex = ex
        self.strip_usage = strip_usage
        self.rename = rename
        self.pending = b""
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk if self.pending else chunk
        end = _events_end(data)
        if end == 0:
            self.pending = data
            return b""
        self.pending = data[end:]
        return self._process(data[:end])

    def flush(self) -> bytes:
        data, self.pending = self.pending, b""
        return self._process(data) if data else b""

    def _process(self, events: bytes) -> bytes:
        self.ex.seat.generated(events.count(b"data:"))
        if b"data: [DONE]" in events or b"data:[DONE]" in events:
            self.done = True
        if b'"usage"' in events:
            events = self._usage(events)
        if self.rename:
            events = rename_model(events, self.rename)
        return events

    def _usage(self, events: bytes) -> bytes:
        if b"\r\n" in events:
            events = events.replace(b"\r\n", b"\n")
        kept = []
        for event in events.split(b"\n\n"):
            if (
                b'"usage"' in event
                and event.startswith(b"data:")
                and b'"usage":null' not in event
                and b'"usage": null' not in event
            ):
                try:
                    obj = json.loads(event[5:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and obj.get("usage"):
                    self.ex.usage(obj["usage"])
                    if self.strip_usage and not obj.get("choices"):
                        continue
            kept.append(event)
        return b"\n\n".join(kept)
