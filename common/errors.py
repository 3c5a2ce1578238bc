"""The OpenAI error vocabulary both servers speak: ``{"error": {"message", "type", "param",
"code"}}``, the ``type`` that goes with each status, and the refusal raised anywhere in request
handling, which each server's middleware answers with ``refusal_response``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

_EXCERPT_CHARS = 128

# OpenAI's types where it has them; ours for what only a proxy or a server under load says.
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
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")


def error_object(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    type_: str | None = None,
) -> dict[str, Any]:
    """The error document; ``type_`` overrides the status's type (e.g. ``model_load_error``)."""
    return {
        "error": {
            "message": message,
            "type": type_ or error_type(status),
            "param": param,
            "code": code,
        }
    }


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    return json.dumps(error_object(status, message, code, param)).encode()


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    type_: str | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(error_object(status, message, code, param, type_)).encode(),
        content_type="application/json",
        headers=headers,
    )


class RequestRefused(Exception):
    """A refused request: ``status``, an OpenAI error ``code`` and ``param``, headers to send
    (e.g. ``Retry-After``), and whether the connection must close because the request's body
    was not read to its end."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.close = close


def refusal_response(refused: RequestRefused) -> web.Response:
    response = error_response(
        refused.status, refused.message, refused.code, refused.param, refused.headers
    )
    if refused.close:
        response.force_close()
    return response


def excerpt(text: str, limit: int = _EXCERPT_CHARS) -> str:
    """A client-controlled string as an error message may quote it: at most ``limit``
    characters, so an answer never grows with what the client sent."""
    return text if len(text) <= limit else text[:limit] + "…"
