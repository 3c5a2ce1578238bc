"""Requests held while their model has no ready replica: a bounded FIFO per model.

A held request waits until a replica of its model becomes ready (``release``), the model fails
(``refuse``), or its own ``max_wait_s`` passes; over ``max_requests`` it is refused at once, and
both refusals say where the model's load stands (``explain``: its replicas' start-up stages). A
client that disconnects cancels its handler, and with it its place in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

from common.errors import error_body
from gateway.config import HoldQueue
from gateway.proxy.failures import UpstreamFailure

RETRY_AFTER_S = 5


def refusal(code: str, message: str, retry_after_s: int = RETRY_AFTER_S) -> UpstreamFailure:
    """A held request's 503, in the usual error shape, with a Retry-After."""
    return UpstreamFailure(
        503,
        error_body(503, message, code),
        code,
        message=message,
        headers={"Retry-After": str(retry_after_s)},
    )


class HoldLine:
    """One model's held requests."""

    def __init__(
        self,
        model: str,
        settings: HoldQueue,
        observe_wait: Callable[[float], None],
        explain: Callable[[], str],
    ) -> None:
        self.model = model
        self.settings = settings
        self._observe_wait = observe_wait
        self._explain = explain  # where the model's load stands, for the refusals
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self) -> None:
        """Returns when the model has a ready replica; raises its refusal otherwise."""
        if len(self._waiters) >= self.settings.max_requests:
            raise refusal(
                "hold_queue_full",
                f"Model '{self.model}' is loading and {len(self._waiters)} requests are already "
                f"waiting for it; {self._explain()}.",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.settings.max_wait_s)
        except TimeoutError:
            raise refusal(
                "model_loading_timeout",
                f"Model '{self.model}' did not become ready within "
                f"{self.settings.max_wait_s:g}s; {self._explain()}.",
            ) from None
        finally:
            self._observe_wait(time.monotonic() - started)
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self) -> None:
        """Lets every held request go, in arrival order."""
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_result(None)

    def refuse(self, failure: Callable[[], UpstreamFailure]) -> None:
        """Answers every held request with a ``failure()`` of its own."""
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_exception(failure())
