"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web

from common.errors import RequestRefused

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_closed_request",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    error = {
        "message": message,
        "type": _TYPES.get(status, "server_error"),
        "param": param,
        "code": code,
    }
    return json.dumps({"error": error}).encode()


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code, param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream which cannot be completed after it started."""
    return b"data: " + error_body(status, message, code) + b"\n\n"


class GatewayHTTPError(RequestRefused):
    """Raised anywhere in request handling; the middleware turns it into an OpenAI error."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, code, param=param, headers=headers)


def refusal_response(refused: RequestRefused) -> web.Response:
    """The answer to a refused request (a GatewayHTTPError or the shared HTTP layer's)."""
    response = error_response(
        refused.status, refused.message, refused.code, refused.param, refused.headers
    )
    if refused.close:
        response.force_close()
    return response
