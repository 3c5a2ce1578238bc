"""How an attempt fails: the failure kinds, each already in the shape the client would get, and
the upstream statuses that decide what an answer means."""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

from common.errors import error_body

JSON = "application/json"
# Answers worth a try on another replica.
RETRY_STATUSES = (502, 503)
# Answers that say the upstream (or a proxy before it) is unwell whatever was asked; the upstream's
# other 5xx may be its answer to a bad request.
GATEWAY_STATUSES = (502, 503, 504)
# Answers whose back-off hints reach the client: an upstream that is rate limited or overloaded
# knows best when to come back.
_HINT_STATUSES = (429, 503)
_HINT_HEADERS = ("retry-after", "retry-after-ms")
_HINT_PREFIX = "x-ratelimit-"
# The engine's answer while it sleeps (parked): a request that got it was routed to the replica just
# before it was parked, and is held while the model wakes.
SLEEPING_CODE = "engine_sleeping"
_TIMEOUT_MESSAGES = {
    "first_byte": "The upstream did not start answering in time.",
    "idle": "The upstream stalled while answering.",
    "total": "The request exceeded its total time limit.",
}


def backoff_hints(status: int, headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream's ``Retry-After``/``retry-after-ms``/``x-ratelimit-*`` of a 429 or 503."""
    if status not in _HINT_STATUSES:
        return {}
    return {
        name: value
        for name, value in headers.items()
        if (lowered := name.lower()) in _HINT_HEADERS or lowered.startswith(_HINT_PREFIX)
    }


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-style error body, None when it has none."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


class UpstreamFailure(Exception):
    """How an attempt failed, already in the shape the client would get."""

    def __init__(
        self,
        status: int,
        body: bytes,
        reason: str,
        content_type: str = JSON,
        message: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message or reason)
        self.status = status
        self.body = body
        self.reason = reason  # bounded: connect, connect_timeout, disconnect, status_502, ...
        self.content_type = content_type
        self.headers = headers or {}  # the upstream's back-off hints, passed to the client

    def final(self) -> UpstreamFailure:
        """The same answer, no longer worth a retry (every replica has been tried)."""
        return UpstreamFailure(
            self.status, self.body, self.reason, self.content_type, headers=self.headers
        )

    def response(self, headers: Mapping[str, str]) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, content_type=self.content_type, headers=headers
        )


class Retryable(UpstreamFailure):
    """A failure before anything reached the client, worth a try on another replica."""


class Asleep(Retryable):
    """The engine answered 503 ``engine_sleeping``: its replica was parked under the request. Not
    a failure of the backend: the request is held while the model wakes (retries.py)."""


def disconnected(
    message: str,
    code: str = "upstream_disconnected",
    reason: str = "disconnect",
    status: int = 502,
) -> Retryable:
    """A connection that failed (by default: the upstream dropped it), with an OpenAI error body."""
    return Retryable(status, error_body(status, message, code), reason)


def timed_out(kind: str) -> UpstreamFailure:
    """``kind``: first_byte, idle or total."""
    message = _TIMEOUT_MESSAGES[kind]
    code = f"upstream_timeout_{kind}"
    return UpstreamFailure(504, error_body(504, message, code), f"timeout_{kind}", message=message)


def no_backend(model: str, retry_after_s: int) -> UpstreamFailure:
    return UpstreamFailure(
        503,
        error_body(503, f"No healthy backend for model '{model}'.", "no_healthy_backend"),
        "no_backend",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_crashed() -> Retryable:
    """The request was in flight when its engine's process died: a suspect (quarantine.py)."""
    message = "The engine serving this request crashed."
    code = "engine_crashed"
    return Retryable(502, error_body(502, message, code), code, message=message)


def request_crashed_engine(model: str, ttl_s: float) -> UpstreamFailure:
    """A request that crashed its engine twice (quarantine.py): answered without forwarding it."""
    message = (
        f"This request crashed the engine of model '{model}' twice; the gateway will not forward "
        f"it again for {ttl_s:g}s."
    )
    code = "request_crashed_engine"
    return UpstreamFailure(502, error_body(502, message, code), code, message=message)


def evicted() -> Retryable:
    """The backend was ejected while the request waited on it (HealthMonitor._evict)."""
    return disconnected(
        "The upstream was ejected while answering.", "upstream_ejected", "ejected", 502
    )
