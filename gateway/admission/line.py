"""The asyncio side of one model's line (scheduler.py decides who goes): requests wait on futures
until the scheduler admits them, give their slot back whatever ends them, and are counted in the
metrics.

A model has ``max_in_flight`` slots per available backend (its ready replicas, for a local
model), at most ``limits.max_concurrency`` in all. Without an available backend it has none, and
its line is where requests wait for a replica to come (a load, a wake, a restart, which ``Supply``
starts), in the same order as requests waiting for a free slot: it is the one line of the model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection

from common.errors import RequestRefused
from gateway.admission import refusals
from gateway.admission.drain import UNMEASURED_RETRY_AFTER_S, DrainRate
from gateway.admission.scheduler import Outcome, Policy, Scheduler, Tenant, Ticket, TicketState
from gateway.backend import Backend
from gateway.metrics import GatewayMetrics
from gateway.router import ModelRoute

# Asked when a request finds its model without an available backend (besides the ones it tried):
# whether a replica is coming, for which it then waits in the line (the call starts a load where
# none is under way); False sends it on to the proxy, whose answer says there is none. Raises the
# request's refusal when the model failed.
Supply = Callable[[ModelRoute, Collection[Backend]], Awaitable[bool]]


# Where the load of a model without a ready replica stands (its replicas' start-up stages), for
# the refusals of the requests waiting for it.
Explain = Callable[[str], str]


async def nothing_coming(route: ModelRoute, tried: Collection[Backend]) -> bool:
    """The supply of a gateway that starts no replicas."""
    return False


def no_load(model: str) -> str:
    """The explanation of a gateway that starts no replicas."""
    return "no replica is loading"


class ModelLine:
    def __init__(
        self, route: ModelRoute, metrics: GatewayMetrics, supply: Supply, explain: Explain
    ) -> None:
        self.metrics = metrics
        self.supply = supply
        self.explain = explain
        self.scheduler = Scheduler()
        self.drain = DrainRate()
        self._seats: dict[Ticket, Seat] = {}  # the waiting ones
        self.configure(route, set())

    def configure(self, route: ModelRoute, tenants: set[str]) -> None:
        """The model's (re)loaded settings; ``tenants``: the configured keys' names."""
        self.route = route
        config = route.config
        self.name = config.name
        self.per_backend = config.max_in_flight
        self.cap = config.limits.max_concurrency
        self.max_wait_s = config.queue.max_wait_s
        policy = Policy(config.admission.policy)
        self.scheduler.configure(policy, config.queue.max_requests, tenants)
        self.pump()

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def capacity(self) -> int:
        ready = 0
        for backend in self.route.backends:
            if backend.available:
                ready += 1
        slots = ready * self.per_backend
        return slots if self.cap is None else min(slots, self.cap)

    def pump(self, now: float | None = None) -> None:
        """Admits whom the scheduler picks while slots are free (after a release, or when
        backends became available)."""
        if not self.scheduler.waiting:
            return
        now = time.monotonic() if now is None else now
        for ticket in self.scheduler.dispatch(self.capacity()):
            seat = self._seats.pop(ticket)
            self._left_line(seat, now)
            self.drain.started(now)
            if seat.future is not None and not seat.future.done():
                seat.future.set_result(None)

    def refuse(self, failure: Callable[[], RequestRefused]) -> None:
        """Answers every waiting request with a ``failure()`` of its own (the model failed, was
        unloaded or removed)."""
        now = time.monotonic()
        for seat in list(self._seats.values()):
            self._withdraw(seat, now)
            refused = self.count(failure())
            if seat.future is not None and not seat.future.done():
                seat.future.set_exception(refused)

    def count(self, refused: RequestRefused) -> RequestRefused:
        """Counts a refusal of this line's (by its code) and returns it, for raising."""
        if refused.code:
            self.metrics.child(self.metrics.admission_refused, self.name, refused.code).inc()
        return refused

    # ---- a seat's way through (Seat calls these) ----

    async def _enter(self, seat: Seat) -> None:
        ticket = seat.ticket
        capacity = self.capacity()
        if self.scheduler.in_flight < capacity and not self.scheduler.waiting:
            self._admit_now(seat)  # the common case: a free slot and nobody before it
            return
        if capacity == 0:
            try:
                coming = await self.supply(self.route, ())
            except RequestRefused as refused:
                ticket.move(TicketState.DONE)
                raise self.count(refused) from None
            if not coming:  # the proxy's answer will say so
                self._admit_now(seat)
                return
            capacity = self.capacity()
        arrival = self.scheduler.arrive(ticket, capacity, self.drain, self.max_wait_s)
        seat.position = ticket.ahead
        if arrival.evicted is not None:
            self._shed(self._seats.pop(arrival.evicted))
        if arrival.outcome is not Outcome.WAITING:
            raise self._refusal(ticket, arrival.outcome, ticket.ahead)
        now = time.monotonic()
        self._joined(seat, now)
        self.pump(now)  # the same clock: a request admitted at once waited 0
        if ticket.state is TicketState.WAITING:
            await self._wait(seat)

    def _admit_now(self, seat: Seat) -> None:
        self.scheduler.admit_now(seat.ticket)
        self.drain.started(time.monotonic())
        self._observe_wait(seat, 0.0)

    def _joined(self, seat: Seat, now: float) -> None:
        seat.queued_at = now
        self._seats[seat.ticket] = seat
        self._depth(seat.ticket, 1)

    async def _wait(self, seat: Seat) -> None:
        """Until the seat is admitted; raises its refusal, or a timeout after ``max_wait_s``."""
        future = seat.future = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await future
            return
        except TimeoutError:
            pass
        finally:
            seat.future = None
        if seat.ticket.state is TicketState.ADMITTED:
            return  # admitted as the timeout fell
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]  # refused as the timeout fell
        self._withdraw(seat, time.monotonic())
        loading = self.capacity() == 0
        retry_after = self._retry_after(self.waiting, loading)
        why = self.explain(self.name) if loading else None
        raise self.count(refusals.timed_out(self.name, self.max_wait_s, why, retry_after))

    async def _hold(self, seat: Seat, tried: Collection[Backend]) -> None:
        try:
            coming = await self.supply(self.route, tried)
        except RequestRefused as refused:
            raise self.count(refused) from None
        if not coming:
            return
        self.scheduler.requeue(seat.ticket)
        now = time.monotonic()
        self._joined(seat, now)
        self.pump(now)
        if seat.ticket.state is TicketState.WAITING:
            await self._wait(seat)

    def _finish(self, seat: Seat, prompt_tokens: int | None, completion: int | None) -> None:
        ticket = seat.ticket
        if ticket.charged and not seat.settled:
            seat.settled = True
            self._settle(seat, prompt_tokens, completion)
        if ticket.state is TicketState.WAITING:  # its client left, or it failed, while waiting
            self._withdraw(self._seats.pop(ticket), time.monotonic())
        elif ticket.state is TicketState.ADMITTED:
            self.scheduler.release(ticket)
            self.drain.completed(time.monotonic(), idle=self.scheduler.in_flight == 0)
            self.pump()

    def _settle(self, seat: Seat, prompt_tokens: int | None, completion: int | None) -> None:
        """Corrects the charges with the upstream's usage, where it came, and counts them."""
        ticket = seat.ticket
        prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
        generated = seat.streamed if completion is None else completion
        correction = prompt - ticket.prompt_tokens + generated - seat.streamed
        if correction:
            self.scheduler.charge(ticket, correction)
        tokens = self.metrics.child(self.metrics.admission_tokens, self.name, ticket.tenant.name)
        tokens.inc(prompt + generated)

    # ---- bookkeeping ----

    def _withdraw(self, seat: Seat, now: float) -> None:
        self._seats.pop(seat.ticket, None)
        self.scheduler.withdraw(seat.ticket)
        self._left_line(seat, now)

    def _shed(self, seat: Seat) -> None:
        """A sheddable waiter dropped for a request that may not be: already withdrawn."""
        self._left_line(seat, time.monotonic())
        refused = self._refusal(seat.ticket, Outcome.SHED, self.waiting)
        if seat.future is not None and not seat.future.done():
            seat.future.set_exception(refused)

    def _left_line(self, seat: Seat, now: float) -> None:
        self._depth(seat.ticket, -1)
        self._observe_wait(seat, now - seat.queued_at)

    def _observe_wait(self, seat: Seat, waited_s: float) -> None:
        seat.wait_s += waited_s
        wait = self.metrics.child(self.metrics.admission_wait, self.name, seat.ticket.tenant.name)
        wait.observe(waited_s)

    def _depth(self, ticket: Ticket, delta: int) -> None:
        band = str(ticket.tenant.band)
        self.metrics.child(self.metrics.admission_depth, self.name, band).inc(delta)

    def _refusal(self, ticket: Ticket, outcome: Outcome, ahead: int) -> RequestRefused:
        """What a request the scheduler refused (or shed from the line) is told."""
        loading = self.capacity() == 0
        retry_after = self._retry_after(ahead, loading)
        if outcome is Outcome.SHED:
            key = ticket.tenant.name
            self.metrics.child(self.metrics.admission_shed, self.name, key).inc()
            refused = refusals.shed(self.name, retry_after)
        else:
            why = self.explain(self.name) if loading else None
            refused = refusals.full(self.name, self.waiting, why, retry_after)
        return self.count(refused)

    def _retry_after(self, ahead: int, loading: bool) -> int:
        """From the drain rate and the work ahead; while the model loads, the drain says
        nothing of when it will be ready."""
        return UNMEASURED_RETRY_AFTER_S if loading else self.drain.retry_after_s(ahead)


class Seat:
    """One request's place in its model's line: waiting, then holding one of the model's slots
    until ``finish``, which the handler calls whatever ends the request."""

    __slots__ = (
        "future", "line", "position", "queued_at", "settled", "streamed", "ticket", "wait_s",
    )  # fmt: skip

    def __init__(self, line: ModelLine, tenant: Tenant, prompt_tokens: int) -> None:
        self.line = line
        self.ticket = Ticket(tenant, prompt_tokens)
        self.future: asyncio.Future[None] | None = None
        self.queued_at = 0.0
        self.wait_s = 0.0  # time spent in the line, every wait added up
        self.position = 0  # requests ahead of it when it arrived
        self.streamed = 0  # generated tokens charged as they streamed
        self.settled = False  # its charges were corrected with the usage and counted

    async def take(self) -> None:
        """Waits for a slot (or for the model's replica to come); raises the refusal."""
        await self.line._enter(self)

    async def hold(self, tried: Collection[Backend]) -> None:
        """The proxy's hook when no backend is available besides ``tried``: gives the slot back
        and waits in the line again while a replica is coming; returns at once when none is."""
        await self.line._hold(self, tried)

    def generated(self, tokens: int) -> None:
        """``tokens`` more streamed to the client: charged now (the usage corrects them)."""
        if self.ticket.state is TicketState.ADMITTED:
            self.streamed += tokens
            self.line.scheduler.charge(self.ticket, tokens)

    def finish(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The request ended (answered, failed, refused or abandoned): its charges corrected
        with the upstream's usage where it came, its slot or its place in the line given
        back. Idempotent."""
        self.line._finish(self, prompt_tokens, completion_tokens)
