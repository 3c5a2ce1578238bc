"""Backend health: active readiness checks and passive outlier ejection.

- Active: each backend's readiness path (``/ready`` for our engines, ``health_path`` per model) is
  fetched every ``interval_s``; ``unhealthy_after`` failures in a row take it out,
  ``healthy_after`` passes in a row bring it back. The first check runs at once and decides alone.
- Passive: ``consecutive_failures`` failed attempts in a row eject a backend for ``base_s`` × its
  ejection count (capped at ``max_s``). Connect errors, resets, timeouts and 502/503/504 answers
  count each time; the upstream's own error answers (500, 501, ...), which a client can provoke
  with a bad body, once per distinct request signature (client, body) in the streak. A streak
  that reaches the threshold only through repeats calls for an active check at once, and a failing
  check ejects. Passive evidence never ejects a model's last available backend, nor more than
  ``max_percent`` of its backends (at least one may always go): the active check then runs at once
  and the checks decide. After its ejection time, the next passing check re-admits a backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Iterable

import aiohttp

from gateway.backend import Backend, Condition
from gateway.config import EjectionSettings, HealthSettings
from gateway.router import ModelRoute, Router

log = logging.getLogger("modelyard.health")


class HealthMonitor:
    """The policies that set and clear a backend's UNHEALTHY and EJECTED conditions."""

    def __init__(
        self,
        router: Router,
        session: aiohttp.ClientSession,
        health: HealthSettings,
        ejection: EjectionSettings,
    ) -> None:
        self.router = router
        self.session = session
        self.health = health
        self.ejection = ejection
        self._tasks: dict[Backend, asyncio.Task[None]] = {}
        self._wakeups: dict[Backend, asyncio.Event] = {}  # lets an ejection end the wait early
        self._suspects: set[Backend] = set()  # checks called for by passive evidence (_check_now)

    def retry_after_s(self) -> int:
        """Whole seconds a client should wait when no backend of a model is available: until the
        next active check can re-admit one."""
        return max(1, math.ceil(self.health.interval_s))

    def configure(self, health: HealthSettings, ejection: EjectionSettings) -> None:
        self.health = health
        self.ejection = ejection

    # ---- active checks: their verdicts (the tasks that run them are further down) ----

    def record_check(self, backend: Backend, passed: bool, first: bool = False) -> None:
        """An active check's verdict. ``healthy_after`` passes in a row clear UNHEALTHY,
        ``unhealthy_after`` failures set it (``first``: the backend's first check, which decides
        alone); a pass after the ejection time re-admits, and a long good spell forgives old
        ejections."""
        was_available = backend.available
        now = time.monotonic()
        if passed:
            backend.check_ok_streak += 1
            backend.check_fail_streak = 0
            if first or backend.check_ok_streak >= self.health.healthy_after:
                backend.set_condition(Condition.UNHEALTHY, False)
            if backend.ejected and now >= backend.ejected_until:
                backend.set_condition(Condition.EJECTED, False)
                backend.clear_failures()
                backend.last_readmit = now
            elif (
                backend.ejection_count
                and not backend.ejected
                and now - backend.last_readmit >= self.ejection.max_s
            ):
                backend.ejection_count = 0  # well-behaved for a long time: forgive old ejections
        else:
            backend.check_fail_streak += 1
            backend.check_ok_streak = 0
            if first or backend.check_fail_streak >= self.health.unhealthy_after:
                backend.set_condition(Condition.UNHEALTHY)
        if backend.available != was_available:
            log.warning(
                "backend %s of model %s is now %s",
                backend.label,
                backend.model,
                "available" if backend.available else "unavailable",
            )

    # ---- passive outlier detection (called by the proxy on every attempt's outcome) ----

    def record_success(self, backend: Backend) -> None:
        if backend.consecutive_failures or backend.repeated_failures:
            backend.clear_failures()

    def record_failure(
        self, route: ModelRoute, backend: Backend, signature: int | None = None
    ) -> None:
        """One failed attempt. ``signature`` None: the backend failed to answer properly (connect
        error, reset, timeout, 502/503/504), which always counts. Else the upstream answered with
        an error that the request itself may have caused: it counts once per signature (its
        client) in the streak, so one client sending bad bodies cannot build one; repeats only
        call for an active check."""
        threshold = self.ejection.consecutive_failures
        if signature is None or signature not in backend.failure_signatures:
            backend.consecutive_failures += 1
            if signature is not None and len(backend.failure_signatures) < threshold:
                backend.failure_signatures.add(signature)  # bounded: more would change nothing
        else:
            backend.repeated_failures += 1
        if backend.ejected:
            return
        if backend.consecutive_failures >= threshold and self._may_eject(route, backend):
            self._eject(backend)
        elif backend.consecutive_failures + backend.repeated_failures >= threshold:
            self._check_now(backend)

    def _may_eject(self, route: ModelRoute, backend: Backend) -> bool:
        """Never the model's last available backend (everyone would get 503 on evidence that
        clients can fake), and at most ``max_percent`` of its backends (at least one)."""
        if not any(b.available for b in route.backends if b is not backend):
            return False
        ejected = sum(1 for b in route.backends if b.ejected)
        return ejected < max(1, math.floor(len(route.backends) * self.ejection.max_percent / 100))

    def _eject(self, backend: Backend) -> None:
        if not backend.set_condition(Condition.EJECTED):
            return  # removed meanwhile
        backend.ejection_count += 1
        duration = min(self.ejection.base_s * backend.ejection_count, self.ejection.max_s)
        backend.ejected_until = time.monotonic() + duration
        backend.clear_failures()
        self._suspects.discard(backend)
        self._evict(backend)
        log.warning(
            "ejected backend %s of model %s for %.1fs (ejection #%d)",
            backend.label,
            backend.model,
            duration,
            backend.ejection_count,
        )
        # Check it again as soon as the ejection time is over rather than at the next interval.
        self._wake(backend, duration)

    def _check_now(self, backend: Backend) -> None:
        """Passive evidence that may not eject alone: the active check runs now and decides
        (``_settle``). One at a time per backend, so a flood of failures is not a flood of
        checks."""
        event = self._wakeups.get(backend)
        if event is None or backend in self._suspects:
            return
        self._suspects.add(backend)
        event.set()

    def _settle(self, backend: Backend, passed: bool) -> None:
        """A check's verdict on a suspect. Failing, it confirms the streak: ejection where the
        model can spare the backend, otherwise ``unhealthy_after`` counts it like any failed
        check. Passing, it clears the streak."""
        if backend not in self._suspects:
            return
        self._suspects.discard(backend)
        route = self.router.routes.get(backend.model)
        if not passed and backend.available and route and self._may_eject(route, backend):
            self._eject(backend)
        else:
            backend.clear_failures()

    @staticmethod
    def _evict(backend: Backend) -> None:
        """Requests still waiting on an ejected backend move on: their handlers are cancelled
        and the proxy turns that into a retry on another replica. Not the caller's own task, which
        is already failing its attempt."""
        current = asyncio.current_task()
        for ex in list(backend.waiting):
            if ex.task is not None and ex.task is not current and ex.evicted_from is None:
                ex.evicted_from = backend
                ex.task.cancel()

    # ---- the check tasks ----

    def sync(self, removed: Iterable[Backend] = ()) -> None:
        """Starts checks for new backends and stops those of removed ones."""
        for backend in removed:
            task = self._tasks.pop(backend, None)
            self._wakeups.pop(backend, None)
            self._suspects.discard(backend)
            if task:
                task.cancel()
        for backend in self.router.backends():
            if backend not in self._tasks:
                self._wakeups[backend] = asyncio.Event()
                self._tasks[backend] = asyncio.create_task(self._check_loop(backend))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _wake(self, backend: Backend, after_s: float) -> None:
        event = self._wakeups.get(backend)
        if event is not None:
            asyncio.get_running_loop().call_later(after_s + 0.01, event.set)

    async def _check_loop(self, backend: Backend) -> None:
        first = True
        while not backend.removed:
            passed = await self._probe(backend)
            self.record_check(backend, passed, first)
            self._settle(backend, passed)
            first = False
            await self._sleep(backend, self.health.interval_s * random.uniform(0.9, 1.1))

    async def _sleep(self, backend: Backend, seconds: float) -> None:
        event = self._wakeups.get(backend)
        if event is None:
            await asyncio.sleep(seconds)
            return
        event.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()

    async def _probe(self, backend: Backend) -> bool:
        route = self.router.routes.get(backend.model)
        path = route.config.health_path if route else "/ready"
        headers = {}
        if route and route.config.api_key:
            headers["Authorization"] = f"Bearer {route.config.api_key}"
        try:
            async with asyncio.timeout(self.health.timeout_s):
                async with self.session.get(backend.url + path, headers=headers) as resp:
                    await resp.read()
                    return 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
