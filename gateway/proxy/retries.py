"""Attempts on one replica after another, while nothing has reached the client.

Retried: connect failures and timeouts, the upstream closing the connection before answering,
502/503 answers, and the backend being ejected while the request waited on it; each time on a
replica not tried yet, after a jittered exponential backoff, within the retry budget. The first
attempt runs outside tenacity: its machinery costs about 40 µs per call, a tenth of the
gateway's whole per-request CPU.

Two answers are not plain retries. A dropped connection whose engine crashed is judged by the
quarantine (quarantine.py): a suspect is retried on probation, a poison request answered. A
replica parked under the request (the engine's 503 ``engine_sleeping``) costs no attempt: the
request waits in its model's line again while the model wakes (its seat's hold wakes it), up to
``MAX_WAKE_WAITS`` times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_random_exponential

from gateway.backend import Backend
from gateway.config import RetrySettings
from gateway.health import HealthMonitor
from gateway.metrics import GatewayMetrics
from gateway.proxy import failures
from gateway.proxy.budget import RetryBudget
from gateway.proxy.exchange import Exchange
from gateway.proxy.failures import Asleep, Retryable, UpstreamFailure
from gateway.proxy.quarantine import Quarantine

T = TypeVar("T")
Attempt = Callable[[Exchange, Backend], Awaitable[T]]  # one try on one backend
MAX_WAKE_WAITS = 3  # sleeping answers one request waits through (a park storm, not a parked model)


class Retrier:
    def __init__(
        self,
        settings: RetrySettings,
        health: HealthMonitor,
        metrics: GatewayMetrics,
        quarantine: Quarantine,
    ) -> None:
        self.settings = settings
        self.quarantine = quarantine
        self.health = health
        self.metrics = metrics
        self.budget = RetryBudget(settings)
        backoff_s = settings.backoff_ms / 1000
        self._wait = wait_random_exponential(multiplier=backoff_s, max=max(backoff_s * 8, 0.001))

    async def run(self, ex: Exchange, attempt: Attempt[T]) -> T:
        """``attempt``'s result, or raises the last failure."""
        self.budget.deposit()
        tried: list[Backend] = []
        try:  # the common case, without the retry machinery's cost
            return await self._try(ex, attempt, tried)
        except Retryable as failure:
            if self.settings.attempts < 2:
                raise
            replay: Retryable | None = failure

        def stop(state: RetryCallState) -> bool:
            return state.attempt_number >= self.settings.attempts or not self.budget.try_spend()

        def before_sleep(state: RetryCallState) -> None:
            ex.retries += 1
            failure = state.outcome.exception() if state.outcome else None
            reason = failure.reason if isinstance(failure, UpstreamFailure) else "unknown"
            self.metrics.retries.labels(ex.route.name, reason).inc()

        retrying = AsyncRetrying(
            stop=stop,
            wait=self._wait,
            reraise=True,
            retry=retry_if_exception_type(Retryable),
            before_sleep=before_sleep,
        )
        async for try_ in retrying:
            with try_:
                if replay is not None:  # tenacity decides on the first attempt's failure too
                    failure, replay = replay, None
                    raise failure
                return await self._try(ex, attempt, tried)
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def _try(self, ex: Exchange, attempt: Attempt[T], tried: list[Backend]) -> T:
        """One attempt on a replica not tried yet (a crash suspect's once its probation turn has
        come); sleeping answers send it back to the hold."""
        await self.quarantine.admit(ex)
        wakes = 0
        while True:
            backend = await self._backend(ex, tried)
            try:
                return await self._attempt(ex, attempt, backend, tried)
            except Asleep as failure:
                wakes += 1
                if wakes > MAX_WAKE_WAITS:
                    raise failure.final() from None

    async def _backend(self, ex: Exchange, tried: list[Backend]) -> Backend:
        """An available replica not tried yet, after the request waited in its model's line
        again while one is coming; raises what the client gets when there is none."""
        backend = ex.route.pick(tried, ex.affinity_key)
        if backend is None:
            await ex.seat.hold(tried)  # a replica loading or restarting: wait for it
            backend = ex.route.pick(tried, ex.affinity_key)
        if backend is None:
            if ex.last_failure is not None:  # every replica tried: answer with the last failure
                raise ex.last_failure.final()
            raise failures.no_backend(ex.route.name, self.health.retry_after_s())
        return backend

    async def _attempt(
        self, ex: Exchange, attempt: Attempt[T], backend: Backend, tried: list[Backend]
    ) -> T:
        tried.append(backend)
        ex.backend = backend.label
        backend.waiting.add(ex)
        try:
            return await attempt(ex, backend)
        except Retryable as failure:
            judged: UpstreamFailure = failure
            if failure.reason == "disconnect":  # dropped: did the engine crash?
                judged = await self.quarantine.judge(ex, backend) or failure
            ex.last_failure = judged
            raise judged from None
        except asyncio.CancelledError:
            if ex.evicted_from is not backend:
                raise  # the client went away, or shutdown
            # Our backend was ejected while we waited for it (see HealthMonitor._evict): the
            # client has seen nothing yet, so this is a failure like any other, worth a retry.
            ex.evicted_from = None
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            failure = failures.evicted()
            ex.last_failure = failure
            raise failure from None
        finally:
            backend.waiting.discard(ex)
