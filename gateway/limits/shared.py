"""The Redis store behind its ``on_error`` policy. While Redis answers, every admission is
decided there; a call that fails (connection, timeout, an error reply) marks it down, with one
log line, and from then on requests go straight to the policy without waiting on Redis:
``allow`` admits unchecked, ``deny`` refuses 429 ``rate_limits_unavailable``, ``local`` takes
from this gateway's own buckets at 1/gateways of every allowance. A background probe with
exponential backoff finds Redis back (one more log line), and the shared buckets apply again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from common.errors import RequestRefused
from gateway.config import SharedState
from gateway.limits.buckets import Bucket, Taken
from gateway.limits.local import LocalStore
from gateway.limits.redis_store import RedisStore
from gateway.metrics import GatewayMetrics

log = logging.getLogger("modelyard.gateway")

STORE_ERRORS = (RedisError, OSError)
PROBE_FIRST_S = 0.1  # the first probe after a failure; doubling up to...
PROBE_MAX_S = 2.0  # ...this, so Redis back is found within 2 s at one call per gateway
FLUSH_S = 0.02  # corrections wait this long for others to join their script call


class SharedLimits:
    share = 1  # Redis holds whole allowances: every gateway takes from the same buckets

    def __init__(self, settings: SharedState, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.redis = RedisStore(settings)
        self.fallback = LocalStore(share=settings.gateways)
        self.metrics = metrics
        self.up = True
        self._decided = metrics.rate_limit_fallbacks.labels(settings.on_error)
        self._probe: asyncio.Task[None] | None = None
        self._flush: asyncio.Task[None] | None = None  # the one corrections join
        self._flushes: set[asyncio.Task[None]] = set()  # held until done, sending or not
        self._next_probe = 0.0  # on the event loop's clock, while down

    def configure(self, buckets: Iterable[Bucket]) -> None:
        self.fallback.configure(buckets)

    async def start(self) -> None:
        """One probe, so that Redis down at start is logged, and probed for, at once."""
        try:
            await self.redis.probe()
        except STORE_ERRORS as exc:
            self._failed(exc)
        else:
            log.info(
                "rate limits: shared through Redis at %s (on_error %s)",
                self.settings.address,
                self.settings.on_error,
            )

    async def close(self) -> None:
        for task in (self._probe, *self._flushes):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.up:
            with contextlib.suppress(*STORE_ERRORS):
                await self.redis.flush_corrections()
        await self.redis.close()

    async def take(self, buckets: Sequence[Bucket], estimate: int) -> Taken | None:
        """The shared buckets' answer, else the policy's (None: admitted unchecked)."""
        if self.up:
            try:
                refused, wait_s, levels = await self.redis.take(buckets, estimate)
            except STORE_ERRORS as exc:
                self._failed(exc)
            else:
                return Taken(refused, wait_s, levels, self)
        self._decided.inc()
        if self.settings.on_error == "local":
            return self.fallback.take(buckets, estimate)
        if self.settings.on_error == "allow":
            return None
        # 429, not 503: a refusal the operator chose, which clients back off from and retry
        # like any rate limit, while the gateway and its upstreams are fine.
        retry_s = max(1, math.ceil(self._next_probe - asyncio.get_running_loop().time()))
        raise RequestRefused(
            429,
            "Rate limits cannot be checked right now (their shared store does not answer); "
            f"retry in {retry_s}s.",
            code="rate_limits_unavailable",
            headers={"Retry-After": str(retry_s)},
        )

    def correct(self, buckets: Sequence[Bucket], delta: int) -> None:
        """Queued, and sent with the others that come within FLUSH_S; while Redis is down,
        dropped (a Redis that went down may have lost the buckets too)."""
        if not self.up:
            return
        self.redis.add_correction(buckets, delta)
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_soon())
            self._flushes.add(self._flush)
            self._flush.add_done_callback(self._flushes.discard)

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_S)
        self._flush = None  # corrections from now on start the next one
        try:
            await self.redis.flush_corrections()
        except STORE_ERRORS as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self._count_error(exc)
        if not self.up:
            return
        self.up = False
        self.redis.drop_corrections()
        self.metrics.rate_limit_store_up.set(0)
        log.warning(
            "rate limits: Redis at %s does not answer (%s: %s); on_error %s decides until it does",
            self.settings.address,
            type(exc).__name__,
            exc,
            self.settings.on_error,
        )
        self._probe = asyncio.create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        loop = asyncio.get_running_loop()
        delay = PROBE_FIRST_S
        while True:
            self._next_probe = loop.time() + delay
            await asyncio.sleep(delay)
            try:
                await self.redis.probe()
                break
            except STORE_ERRORS as exc:
                self._count_error(exc)
                delay = min(2 * delay, PROBE_MAX_S)
        self.up = True
        self._probe = None
        self.metrics.rate_limit_store_up.set(1)
        log.warning(
            "rate limits: Redis at %s answers again; the shared limits apply",
            self.settings.address,
        )

    def _count_error(self, exc: BaseException) -> None:
        if isinstance(exc, (RedisTimeout, TimeoutError)):
            kind = "timeout"
        elif isinstance(exc, (RedisConnectionError, OSError)):
            kind = "connection"
        else:
            kind = "response"
        self.metrics.rate_limit_store_errors.labels(kind).inc()
