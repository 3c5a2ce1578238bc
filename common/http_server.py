"""The aiohttp runner both servers use: every answer is OpenAI-shaped JSON, even those given
before a request reaches the app, and no client can hold the server's connections.

- Parser refusals (aiohttp answers them itself, in plain text, before any middleware runs): a
  request line or header field longer than the ``max_line_size`` / ``max_field_size`` handler
  args, or too many header lines → 431 ``request_header_fields_too_large``; any other unparsable
  request → 400 ``invalid_http_request``; an error escaping the app → 500 ``internal_error``.
- Deadlines (``ClientLimits``): a connection that sends nothing, or nothing more after a response,
  is closed after ``idle_timeout_s`` (aiohttp's keep-alive timer); a request head must be complete
  ``header_timeout_s`` after its first byte, else 408; the body's deadline is ``read_body``'s.
- Caps: ``max_connections`` open connections, ``max_connections_per_address`` from one address
  (common/connections.py: idle ones make room, busy ones are never dropped); the open-file limit
  is raised to its hard limit at start, and the cap lowered (with a warning) if fds cannot cover
  it.
- HTTP versions other than 1.0 and 1.1 (aiohttp parses ``HTTP/0.9`` and ``HTTP/2.0`` request lines)
  → 400 ``http_version_not_supported``, answered as HTTP/1.1 (not 505: dashboards and alerts
  read 5xx as the server's fault).
- ``Expect``: anything but ``100-continue`` → 417; ``100-continue`` with a declared body over the
  limit → 413 before the client sends it, instead of ``100 Continue`` and then 413.

Leans on aiohttp internals (``RequestHandler.handle_error``, ``_keepalive_handle``,
``_messages``, ``Server._kwargs``, ``BaseRequest._version``), stable across 3.x;
tests/gateway/client_hardening/, tests/gateway/test_http_edges.py and
tests/engine/test_server_errors.py fail if an upgrade changes them.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from common.connections import ConnectionTable
from common.errors import RequestRefused

# (status, message, code) -> the JSON error body, in the caller's own OpenAI error style.
ErrorBody = Callable[[int, str, str], bytes]

# aiohttp's message when a request has more header lines than its parser allows.
_TOO_MANY_HEADERS = "too many headers"
# aiohttp's defaults for the handler args that bound a request's head.
_DEFAULT_LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}
# How long a refused connection may still send (its request, unread) before it is closed: closing
# with unread data sends a reset, which can destroy the refusal before the client reads it.
_REFUSAL_LINGER_S = 2.0
_HTTP_1 = (HttpVersion10, HttpVersion11)
_FD_RESERVE = 64  # files the process needs besides client connections (logs, models, sockets)


@dataclass(frozen=True)
class ClientLimits:
    """How long a client may take, and how many connections it and everyone may hold."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    max_connections: int = 8192
    max_connections_per_address: int = 1024


def _is_header_overflow(exc: BaseException | None) -> bool:
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and _TOO_MANY_HEADERS in exc.message.lower()
    )


def raw_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 answer for a connection the app never sees; it closes after."""
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def raise_fd_limit(log: logging.Logger) -> int:
    """Raises the soft open-file limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


@dataclass(frozen=True)
class _Guard:
    """What every connection of one server shares."""

    error_body: ErrorBody
    name: str  # who answers, in messages: "gateway", "engine"
    log: logging.Logger
    header_bytes: int  # the stricter of the request line and header field limits
    header_lines: int
    limits: ClientLimits
    table: ConnectionTable

    def refusal_bytes(self, refusal: RequestRefused) -> bytes:
        body = self.error_body(refusal.status, refusal.message, refusal.code)
        return raw_response(refusal.status, body, refusal.headers)


class _GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, with the deadlines, the connection table and JSON
    parser refusals. States: idle (no request head begun) → head (bytes arriving, under the head
    deadline) → request (parsed, in the app) → idle again after the response."""

    def __init__(self, *args: Any, guard: _Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard
        self._idle = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # ---- connection lifecycle ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        refusal = self._guard.table.open(self, address)
        if refusal is not None:
            self._guard.log.debug("refused a connection from %s: %s", address, refusal.message)
            self._refuse(refusal)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.table.close(self)
        self._cancel_head_timer()
        super().connection_lost(exc)

    def evict(self) -> None:
        self._guard.log.debug("closing an idle connection to make room for a new one")
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what a refused client still sends is dropped until it hangs up
        if self._idle and data:
            self._start_head()
        super().data_received(data)
        if self._head_timer is not None and self._messages:
            self._cancel_head_timer()  # the head is complete: the app's deadlines take over

    async def finish_response(self, request: web.BaseRequest, resp: Any, start_time: Any) -> Any:
        result = await super().finish_response(request, resp, start_time)
        # Idle once the exchange is over; a pipelined request already parsed keeps it busy, and
        # a body the app left unread is aiohttp's to discard (its lingering, then a close).
        if not self._messages and request.content.is_eof():
            self._idle = True
            self._guard.table.idle(self)
        return result

    # ---- the head deadline ----

    def _start_head(self) -> None:
        self._idle = False
        self._guard.table.busy(self)
        if self._keepalive_handle is not None:  # idle no more: the head deadline rules now
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        timeout = self._guard.limits.header_timeout_s
        self._head_timer = self._loop.call_later(timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._messages or self._request_in_progress:
            return
        timeout = self._guard.limits.header_timeout_s
        self._refuse(
            RequestRefused(
                408,
                f"The request head (request line and headers) did not arrive within {timeout:g} s.",
                "request_timeout",
                close=True,
            )
        )

    def _refuse(self, refusal: RequestRefused) -> None:
        """Answers without the app and closes: at once for the writing side, after a short
        linger for the reading side (see _REFUSAL_LINGER_S)."""
        self._refused = True
        self._guard.table.close(self)
        transport = self.transport
        if transport is None:
            return
        transport.write(self._guard.refusal_bytes(refusal))
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(_REFUSAL_LINGER_S, self.force_close)

    # ---- parser refusals ----

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("Response is sent already, cannot send an error answer")
        guard = self._guard
        if status >= 500:
            guard.log.error("error handling request from %s", request.remote, exc_info=exc)
            status = 500
            body = guard.error_body(500, f"Internal {guard.name} error.", "internal_error")
        elif _is_header_overflow(exc):
            # Client errors are not logged above debug: anyone can send them, at any rate.
            guard.log.debug("request headers too large from %s: %s", request.remote, exc)
            status = 431
            body = guard.error_body(
                431,
                f"Request header fields too large: the request line and every header field must "
                f"fit the {guard.name}'s limit of {guard.header_bytes} bytes, in at most "
                f"{guard.header_lines} header lines.",
                "request_header_fields_too_large",
            )
        else:
            guard.log.debug("unparsable request from %s: %s", request.remote, exc)
            status = 400
            body = guard.error_body(400, "Malformed HTTP request.", "invalid_http_request")
        # The parser's state is unknown: this connection ends here, and the client is told so.
        response = web.Response(
            status=status,
            body=body,
            content_type="application/json",
            headers={"Connection": "close"},
        )
        response.force_close()
        return response


class _GuardedServer(web.Server):
    def __init__(self, *args: Any, guard: _Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedRequestHandler(self, loop=self._loop, guard=self._guard, **self._kwargs)


def _expect_checked(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    guard: _Guard,
    max_body_bytes: Callable[[], int],
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The app's handler behind the ``Expect`` checks, which aiohttp runs before middlewares."""

    def refuse(status: int, message: str, code: str) -> web.Response:
        response = web.Response(
            status=status,
            body=guard.error_body(status, message, code),
            content_type="application/json",
        )
        response.force_close()  # the body (if the client sends it anyway) stays unread
        return response

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.version not in _HTTP_1:
            # aiohttp answers in the version asked for ("HTTP/2.0 405 ..."), which no HTTP/1.x
            # client can read: the refusal goes out as HTTP/1.1.
            request._version = HttpVersion11
            request._cache.pop("version", None)  # a reified property
            return refuse(
                400, "HTTP version not supported: send HTTP/1.1.", "http_version_not_supported"
            )
        expect = request.headers.get("Expect")
        if expect is not None:
            if expect.strip().lower() != "100-continue":
                return refuse(
                    417, "Unsupported Expect header: only 100-continue is.", "expectation_failed"
                )
            limit = max_body_bytes()
            if request.content_length is not None and request.content_length > limit:
                return refuse(413, f"Request body is larger than {limit} bytes.", "body_too_large")
        return await handler(request)

    return handle


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` with the connection guard and JSON refusals described above.

    Header limits come from the app's ``handler_args`` (``max_line_size``, ``max_field_size``,
    ``max_headers``); ``max_body_bytes`` is a callable so that the ``Expect`` check follows a
    limit that changes at run time; ``fds_per_connection`` is how many files one client
    connection costs the process (a proxy holds an upstream connection for each)."""

    def __init__(
        self,
        app: web.Application,
        *,
        error_body: ErrorBody,
        name: str,
        log: logging.Logger,
        limits: ClientLimits,
        max_body_bytes: Callable[[], int],
        fds_per_connection: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._error_body = error_body
        self._name = name
        self._log = log
        self._limits = limits
        self._max_body_bytes = max_body_bytes
        self._fds_per_connection = fds_per_connection
        self.connections: ConnectionTable | None = None

    def _connection_cap(self) -> int:
        fd_limit = raise_fd_limit(self._log)
        fits = max(1, (fd_limit - _FD_RESERVE) // self._fds_per_connection)
        if fits < self._limits.max_connections:
            self._log.warning(
                "open-file limit %d covers %d client connections, not the configured %d: "
                "capping at %d (raise `ulimit -n` to allow more)",
                fd_limit,
                fits,
                self._limits.max_connections,
                fits,
            )
        return min(fits, self._limits.max_connections)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        head = {key: server._kwargs.get(key, default) for key, default in _DEFAULT_LIMITS.items()}
        self.connections = ConnectionTable(
            self._connection_cap(), self._limits.max_connections_per_address
        )
        guard = _Guard(
            self._error_body,
            self._name,
            self._log,
            header_bytes=min(head["max_line_size"], head["max_field_size"]),
            header_lines=head["max_headers"],
            limits=self._limits,
            table=self.connections,
        )
        kwargs = {
            **server._kwargs,
            # read_body decodes under the size limit; aiohttp would inflate first.
            "auto_decompress": False,
            "keepalive_timeout": self._limits.idle_timeout_s,
            # A body the app did not read (refused early, or cut off at its deadline) is read and
            # dropped for this long before the connection closes, as for a refused connection.
            "lingering_time": _REFUSAL_LINGER_S,
        }
        return _GuardedServer(
            _expect_checked(server.request_handler, guard, self._max_body_bytes),
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            guard=guard,
            **kwargs,
        )
