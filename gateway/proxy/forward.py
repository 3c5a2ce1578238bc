"""The proxy: one client request forwarded to a backend of its model, retried on another replica
while nothing has reached the client, then answered (unary) or relayed (stream). A known poison
request is answered without being forwarded (quarantine.py)."""

from __future__ import annotations

import asyncio
from functools import partial

import aiohttp
from aiohttp import web

from gateway.config import RetrySettings
from gateway.health import HealthMonitor
from gateway.metrics import GatewayMetrics
from gateway.proxy import stream, unary
from gateway.proxy.exchange import Exchange
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.quarantine import CrashCheck, Quarantine
from gateway.proxy.retries import Retrier
from gateway.proxy.upstream import Upstream


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        health: HealthMonitor,
        metrics: GatewayMetrics,
        retries: RetrySettings,
        engine_crashed: CrashCheck,
    ) -> None:
        self.health = health
        self.metrics = metrics
        self.quarantine = Quarantine(metrics, engine_crashed)
        self.upstream = Upstream(session, health, metrics)
        self._fetch = partial(unary.fetch, self.upstream)
        self._open_stream = partial(stream.open_stream, self.upstream)
        self.configure(retries)

    def configure(self, retries: RetrySettings) -> None:
        """Applies new retry settings (a fresh retry budget with them)."""
        self.retrier = Retrier(retries, self.health, self.metrics, self.quarantine)

    async def forward(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        ex.task = asyncio.current_task()
        try:
            poison = self.quarantine.refusal(ex)
            if poison is not None:
                raise poison
            if ex.stream:
                opened = await self.retrier.run(ex, self._open_stream)
                response = await stream.relay(self.upstream, self.quarantine, request, ex, opened)
                if ex.error is None:
                    self.quarantine.answered(ex)
                return response
            answer = await self.retrier.run(ex, self._fetch)
            self.quarantine.answered(ex)
        except UpstreamFailure as failure:
            ex.status, ex.error = failure.status, failure.reason
            return failure.response(ex.response_headers(failure.headers))
        finally:
            self.quarantine.release(ex)
        ex.status = answer.status
        return unary.respond(ex, answer)
