"""The aiohttp runner around the gateway app (common/http_server.py): parser-level refusals and
connection-level ones (caps, deadlines) answer in the gateway's OpenAI error shape, with the
client limits of models.yaml's ``gateway.clients``."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from common.errors import error_body
from common.http_server import GuardedRunner
from gateway.state import GATEWAY_KEY

log = logging.getLogger("modelyard.gateway")

# A proxied request holds the client's connection and one to the upstream.
_FDS_PER_CONNECTION = 2


class GatewayRunner(GuardedRunner):
    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        gateway = app[GATEWAY_KEY]
        super().__init__(
            app,
            error_body=error_body,
            name="gateway",
            log=log,
            limits=gateway.config.gateway.clients,
            max_body_bytes=lambda: gateway.config.gateway.max_body_bytes,
            fds_per_connection=_FDS_PER_CONNECTION,
            **kwargs,
        )
