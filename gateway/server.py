"""The aiohttp server around the gateway app, answering in the OpenAI error shape even when a
request never reaches the app: aiohttp's HTTP parser refuses malformed or oversized requests
itself, with a plain-text answer, before any middleware runs. This runner swaps in a request
handler (aiohttp's per-connection protocol) whose error answer is ``{"error": {...}}`` JSON.

Mapping: a request line or header field longer than ``max_header_bytes`` (or too many header lines)
→ 431 ``request_header_fields_too_large``; any other unparsable request → 400
``invalid_http_request``; an error escaping the app → 500 ``internal_error``.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from gateway.errors import error_body

log = logging.getLogger("modelyard.gateway")

# aiohttp's message when a request has more header lines than its parser allows.
_TOO_MANY_HEADERS = "too many headers"


def _is_header_overflow(exc: BaseException | None) -> bool:
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and _TOO_MANY_HEADERS in exc.message.lower()
    )


class _JsonErrorRequestHandler(RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("Response is sent already, cannot send an error answer")
        if status >= 500:
            log.error("error handling request from %s", request.remote, exc_info=exc)
            status = 500
            body = error_body(500, "Internal gateway error.", "internal_error")
        elif _is_header_overflow(exc):
            # Client errors are not logged above debug: anyone can send them, at any rate.
            log.debug("request headers too large from %s: %s", request.remote, exc)
            status = 431
            body = error_body(
                431,
                "Request header fields too large: the request line and every header field must "
                "fit the gateway's max_header_bytes.",
                "request_header_fields_too_large",
            )
        else:
            log.debug("unparsable request from %s: %s", request.remote, exc)
            status = 400
            body = error_body(400, "Malformed HTTP request.", "invalid_http_request")
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
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser-level errors in the OpenAI shape.

    Leans on aiohttp internals (``RequestHandler.handle_error``, ``Server._kwargs``), stable across
    3.x; tests/gateway/test_http_edges.py fails if an upgrade changes them."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _JsonErrorServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )
