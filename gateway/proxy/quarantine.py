"""Poison requests: a request that kills the engine serving it (through any bug: a grammar that
overflowed its compiler's stack once did) must not be re-sent as it is, or it kills the restarted
engine too, again and again, and everyone else's requests with it.

- **Suspect**: a request whose connection to a local engine dropped while that engine's process
  died (``engine_crashed``; an engine the pool stops is no crash). A crash has every request then
  in flight as suspects and at most one culprit, so none is blamed yet: each suspect's signature
  (model, path and body digest, whoever sends it) is remembered, and the suspect is retried.
- **Probation**: a request whose signature is a suspect's, the gateway's own retry or anyone's
  later send, runs only while no other suspect of its model runs (one lock per model). Suspects
  are thus tried one at a time: the next crash points at one signature, not at every request that
  shared both crashes (a load generator's identical bodies would otherwise be blamed with the
  poison one they were held and re-sent beside).
- **Poison**: a suspect whose probation attempt ends in its engine's crash too. Its signature is
  answered 502 ``request_crashed_engine``, never forwarded, for ``TTL_S``.
- A suspect that gets an answer is cleared; every signature is forgotten after ``TTL_S``.

So the bystanders of a crash (of a poison request, the OOM killer, a kill -9) are still answered,
and a poison body costs its engine two crashes per ``TTL_S``. A suspect is blamed wrongly only if
a second, fresh poison request crashes the engine during its probation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gateway.backend import Backend
from gateway.metrics import GatewayMetrics
from gateway.proxy import failures
from gateway.proxy.exchange import Exchange
from gateway.proxy.failures import UpstreamFailure

log = logging.getLogger("modelyard.proxy")

TTL_S = 600.0  # how long a signature stays suspect or poison
MAX_SIGNATURES = 1024  # of each kind; past it the oldest is forgotten
# Whether the engine behind a backend has just died (not been stopped): the residency manager's.
CrashCheck = Callable[[Backend], Awaitable[bool]]


class Signatures:
    """Request signatures remembered for ``TTL_S``, at most ``MAX_SIGNATURES``. Kept in the order
    they expire: every one lives as long."""

    def __init__(self) -> None:
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)

    def __bool__(self) -> bool:
        self._forget_expired()
        return bool(self._until)

    def __contains__(self, signature: bytes) -> bool:
        self._forget_expired()
        return signature in self._until

    def add(self, signature: bytes) -> None:
        self._until.pop(signature, None)
        self._until[signature] = time.monotonic() + TTL_S
        while len(self._until) > MAX_SIGNATURES:
            self._until.popitem(last=False)

    def discard(self, signature: bytes) -> bool:
        """True when it was there."""
        return self._until.pop(signature, None) is not None


class Quarantine:
    """The proxy's memory of suspect and poison requests, and the probation of suspects."""

    def __init__(self, metrics: GatewayMetrics, engine_crashed: CrashCheck) -> None:
        self.metrics = metrics
        self.engine_crashed = engine_crashed
        self.suspects = Signatures()
        self.poison = Signatures()
        self._probation: dict[str, asyncio.Lock] = {}  # per model

    def refusal(self, ex: Exchange) -> UpstreamFailure | None:
        """The answer to a known poison request (not forwarded); None for any other."""
        if not self.poison or ex.digest() not in self.poison:
            return None
        self._count(ex, "refused")
        return failures.request_crashed_engine(ex.route.name, TTL_S)

    async def admit(self, ex: Exchange) -> None:
        """Before an attempt: a suspect waits until no other suspect of its model runs, within
        the request's total time. It keeps its turn until it ends (``release``)."""
        if ex.probation is not None or not self.suspects or ex.digest() not in self.suspects:
            return
        turn = self._probation.setdefault(ex.route.name, asyncio.Lock())
        try:
            async with asyncio.timeout_at(ex.deadline(asyncio.get_running_loop().time())):
                await turn.acquire()
        except TimeoutError:
            raise failures.timed_out("total") from None
        ex.probation = turn

    def release(self, ex: Exchange) -> None:
        """The request ended: the next suspect of its model may run."""
        if ex.probation is not None:
            ex.probation.release()
            ex.probation = None

    def answered(self, ex: Exchange) -> None:
        """The engine answered ``ex`` (whatever the answer): it is no poison request."""
        if ex.probation is not None:
            self._count(ex, "cleared")
        if self.suspects:
            self.suspects.discard(ex.digest())

    async def judge(self, ex: Exchange, backend: Backend) -> UpstreamFailure | None:
        """After ``ex``'s connection to ``backend`` dropped: None unless its engine crashed, else
        the failure to answer or retry it with: a suspect's ``engine_crashed`` (retryable), or, if
        it was on probation already, ``request_crashed_engine`` (final; it is poison now)."""
        if not await self.engine_crashed(backend):
            return None
        signature = ex.digest()
        poison = ex.probation is not None  # its second crash, and the first with no other suspect
        if poison:
            self.suspects.discard(signature)
        (self.poison if poison else self.suspects).add(signature)
        self._count(ex, "marked" if poison else "suspect")
        log.log(
            logging.WARNING if poison else logging.INFO,
            "request %s (signature %s) was in flight when engine %s of model %s crashed%s",
            ex.request_id,
            signature.hex()[:12],
            backend.label,
            ex.route.name,
            f" again, on probation: poison, refused for {TTL_S:.0f}s"
            if poison
            else ": a suspect, retried on probation",
        )
        if poison:
            return failures.request_crashed_engine(ex.route.name, TTL_S)
        return failures.engine_crashed()

    def _count(self, ex: Exchange, result: str) -> None:
        self.metrics.child(self.metrics.poison_requests, ex.route.name, result).inc()
