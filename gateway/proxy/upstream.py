"""One attempt's exchange with a backend: sending the request, and recording what its outcome says
about the backend's health (passive detection) and in the metrics."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.backend import Backend
from gateway.health import HealthMonitor
from gateway.metrics import GatewayMetrics
from gateway.proxy import failures
from gateway.proxy.exchange import Exchange
from gateway.proxy.failures import (
    GATEWAY_STATUSES,
    JSON,
    RETRY_STATUSES,
    SLEEPING_CODE,
    Asleep,
    Retryable,
    UpstreamFailure,
    backoff_hints,
    error_code,
)


@dataclass(frozen=True, slots=True)
class Answer:
    """An upstream's whole (unary) answer."""

    status: int
    body: bytes
    content_type: str
    hints: dict[str, str]  # its back-off hints (see backoff_hints)

    @classmethod
    def of(cls, resp: aiohttp.ClientResponse, body: bytes) -> Answer:
        return cls(
            resp.status, body, resp.content_type or JSON, backoff_hints(resp.status, resp.headers)
        )

    @property
    def asleep(self) -> bool:
        """The engine's 503 ``engine_sleeping`` (the body is read only for a 503)."""
        return self.status == 503 and error_code(self.body) == SLEEPING_CODE

    def failure(self, kind: type[UpstreamFailure] = UpstreamFailure) -> UpstreamFailure:
        return kind(
            self.status, self.body, f"status_{self.status}", self.content_type, headers=self.hints
        )

    def response(self, ex: Exchange) -> web.Response:
        return web.Response(
            status=self.status,
            body=self.body,
            content_type=self.content_type,
            headers=ex.response_headers(self.hints),
        )


class Upstream:
    def __init__(
        self, session: aiohttp.ClientSession, health: HealthMonitor, metrics: GatewayMetrics
    ) -> None:
        self.session = session
        self.health = health
        self.metrics = metrics
        self._client_timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def send(self, ex: Exchange, backend: Backend) -> aiohttp.ClientResponse:
        """Posts the request and waits for the response headers (the caller bounds the wait)."""
        config = ex.route.config
        headers = {"Content-Type": JSON, "x-request-id": ex.request_id}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        try:
            return await self.session.post(
                backend.url + ex.path,
                data=ex.body,
                headers=headers,
                timeout=self._client_timeout(config.timeouts.connect_s),
            )
        except aiohttp.ConnectionTimeoutError as exc:
            self.metrics.timeouts.labels(ex.route.name, "connect").inc()
            failure = failures.disconnected(
                "Timed out connecting to the upstream.",
                "upstream_connect_timeout",
                "connect_timeout",
                504,
            )
            raise self.connection_failed(ex, backend, failure) from exc
        except aiohttp.ClientConnectorError as exc:
            failure = failures.disconnected(
                "Could not connect to the upstream.", "upstream_connect_error", "connect", 502
            )
            raise self.connection_failed(ex, backend, failure) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            failure = failures.disconnected("The upstream closed the connection.")
            raise self.connection_failed(ex, backend, failure) from exc

    def _client_timeout(self, connect_s: float) -> aiohttp.ClientTimeout:
        timeout = self._client_timeouts.get(connect_s)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
            self._client_timeouts[connect_s] = timeout
        return timeout

    def observe_latency(self, ex: Exchange, backend: Backend, seconds: float) -> None:
        """Time to the response headers."""
        self.metrics.child(self.metrics.upstream_latency, ex.route.name, backend.label).observe(
            seconds
        )

    def judge(self, ex: Exchange, backend: Backend, answer: Answer) -> None:
        """Passive health bookkeeping for an answered attempt; raises for retryable answers. A
        sleeping engine is not a failing one: it was parked under the request."""
        if answer.status < 500:
            self.succeeded(backend)
            return
        if answer.asleep:
            raise answer.failure(Asleep)
        self.failed(ex, backend, answered=answer.status not in GATEWAY_STATUSES)
        if answer.status in RETRY_STATUSES:
            raise answer.failure(Retryable)

    def succeeded(self, backend: Backend) -> None:
        self.health.record_success(backend)

    def failed(self, ex: Exchange, backend: Backend, answered: bool = False) -> None:
        """``answered``: the upstream answered with an error status of its own (500, 501, ...),
        which the request may have caused: health counts it once per client (API key, else
        address), whatever the body. Counted per body, one client varying its bad bodies would
        build a streak alone and eject every replica but the last."""
        signature = hash(ex.client) if answered else None
        self.health.record_failure(ex.route, backend, signature)

    def connection_failed(self, ex: Exchange, backend: Backend, failure: Retryable) -> Retryable:
        """Records a connection that failed (refused, timed out, reset, closed early); returns
        ``failure`` for the caller to raise."""
        self.failed(ex, backend)
        return failure

    def timed_out(self, ex: Exchange, backend: Backend, phase: str, total: bool) -> UpstreamFailure:
        """Records a timeout in ``phase`` (first_byte or idle; ``total`` when the whole request's
        time ran out); returns the failure to raise or report."""
        kind = "total" if total else phase
        self.metrics.timeouts.labels(ex.route.name, kind).inc()
        self.failed(ex, backend)
        return failures.timed_out(kind)
