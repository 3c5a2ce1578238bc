"""The aiohttp runner around the gateway app: parser-level refusals (oversized headers, malformed
HTTP) answer in the gateway's OpenAI error shape; see engine/http_errors.py, shared with the
engine's server."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from engine.http_errors import JsonErrorRunner
from gateway.errors import error_body

log = logging.getLogger("modelyard.gateway")


class GatewayRunner(JsonErrorRunner):
    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, error_body=error_body, name="gateway", log=log, **kwargs)
