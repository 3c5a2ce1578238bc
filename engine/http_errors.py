"""An aiohttp runner that answers in the OpenAI error shape even when a request never reaches the
app: aiohttp's HTTP parser refuses malformed or oversized requests itself, with a plain-text
answer, before any middleware runs. This runner swaps in a request handler (aiohttp's
per-connection protocol) whose error answer is ``{"error": {...}}`` JSON.

Mapping: a request line or header field longer than the app's ``max_line_size`` /
``max_field_size`` handler args (or too many header lines) → 431
``request_header_fields_too_large``; any other unparsable request → 400 ``invalid_http_request``;
an error escaping the app → 500 ``internal_error``.

Shared by the engine's server and the gateway's; imports nothing heavy (no torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

# (status, message, code) -> the JSON error body, in the caller's own OpenAI error style.
ErrorBody = Callable[[int, str, str], bytes]

# aiohttp's message when a request has more header lines than its parser allows.
_TOO_MANY_HEADERS = "too many headers"
# aiohttp's defaults for the handler args that bound a request's head.
_DEFAULT_LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}


def _is_header_overflow(exc: BaseException | None) -> bool:
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and _TOO_MANY_HEADERS in exc.message.lower()
    )


@dataclass(frozen=True)
class _ErrorAnswers:
    error_body: ErrorBody
    name: str  # who answers, in messages: "gateway", "engine"
    log: logging.Logger
    header_bytes: int  # the stricter of the request line and header field limits
    header_lines: int


class _JsonErrorRequestHandler(RequestHandler):
    def __init__(self, *args: Any, answers: _ErrorAnswers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._answers = answers

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("Response is sent already, cannot send an error answer")
        answers = self._answers
        if status >= 500:
            answers.log.error("error handling request from %s", request.remote, exc_info=exc)
            status = 500
            body = answers.error_body(500, f"Internal {answers.name} error.", "internal_error")
        elif _is_header_overflow(exc):
            # Client errors are not logged above debug: anyone can send them, at any rate.
            answers.log.debug("request headers too large from %s: %s", request.remote, exc)
            status = 431
            body = answers.error_body(
                431,
                f"Request header fields too large: the request line and every header field must "
                f"fit the {answers.name}'s limit of {answers.header_bytes} bytes, in at most "
                f"{answers.header_lines} header lines.",
                "request_header_fields_too_large",
            )
        else:
            answers.log.debug("unparsable request from %s: %s", request.remote, exc)
            status = 400
            body = answers.error_body(400, "Malformed HTTP request.", "invalid_http_request")
        # The parser's state is unknown: this connection ends here, and the client is told so.
        response = web.Response(
            status=status,
            body=body,
            content_type="application/json",
            headers={"Connection": "close"},
        )
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __init__(self, *args: Any, answers: _ErrorAnswers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._answers = answers

    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(
            self, loop=self._loop, answers=self._answers, **self._kwargs
        )


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser-level errors in the OpenAI shape.

    Header limits come from the app's ``handler_args`` (``max_line_size``, ``max_field_size``,
    ``max_headers``). Leans on aiohttp internals (``RequestHandler.handle_error``,
    ``Server._kwargs``), stable across 3.x; tests/gateway/test_http_edges.py and
    tests/test_server_errors.py fail if an upgrade changes them."""

    def __init__(
        self,
        app: web.Application,
        *,
        error_body: ErrorBody,
        name: str,
        log: logging.Logger,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._error_body = error_body
        self._name = name
        self._log = log

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        limits = {key: server._kwargs.get(key, default) for key, default in _DEFAULT_LIMITS.items()}
        answers = _ErrorAnswers(
            self._error_body,
            self._name,
            self._log,
            header_bytes=min(limits["max_line_size"], limits["max_field_size"]),
            header_lines=limits["max_headers"],
        )
        return _JsonErrorServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            answers=answers,
            **server._kwargs,
        )
