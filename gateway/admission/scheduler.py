"""One model's line: who waits, who holds one of the model's slots, and who goes next. Pure: no
asyncio and no clock (the caller passes capacity and the drain rate), so every decision can be
tested step by step.

Order: strict priority bands, the highest first; within a band, under ``fair`` the tenant with the
smallest virtual token counter (vtc.py), its oldest request first; under ``fcfs`` the band's
oldest request. A request is charged its prompt tokens when it is admitted and its generated tokens
as the caller reports them, each divided by its tenant's weight, whatever the policy (so that a
reload may switch policies without losing the counters).

Overload: at most ``max_waiting`` requests wait. A sheddable arrival is refused (``SHED``) when
the line is full, or when the drain rate says it would wait longer than ``max_wait_s``; a
non-sheddable arrival at a full line takes the place of the most recent sheddable waiter of its
band or a lower one (the lowest such band first), and is refused (``FULL``) when there is none.
A request sent back to the line (its replica went away under it, see ``requeue``) was accepted
once: it returns to the head of its tenant's queue, past the bound.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from gateway.admission.drain import DrainRate
from gateway.admission.vtc import VirtualCounters


class Policy(enum.Enum):
    FAIR = "fair"
    FCFS = "fcfs"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is charged to (an API key), and how it is served."""

    name: str
    band: int = 0
    weight: float = 1.0
    sheddable: bool = False


class TicketState(enum.Enum):
    NEW = "new"  # not in the line yet
    WAITING = "waiting"  # in the line
    ADMITTED = "admitted"  # holding a slot
    DONE = "done"  # released, refused, shed, withdrawn: out for good


_MOVES = {
    TicketState.NEW: frozenset({TicketState.WAITING, TicketState.ADMITTED, TicketState.DONE}),
    TicketState.WAITING: frozenset({TicketState.ADMITTED, TicketState.DONE}),
    TicketState.ADMITTED: frozenset({TicketState.WAITING, TicketState.DONE}),
    TicketState.DONE: frozenset(),
}


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place: in the line, then in a slot."""

    tenant: Tenant
    prompt_tokens: int  # charged when it is first admitted
    state: TicketState = TicketState.NEW
    seq: int = -1  # arrival order
    ahead: int = 0  # requests to go before it when it arrived (under fair, an estimate)
    charged: bool = False  # its prompt tokens were charged

    def move(self, state: TicketState) -> None:
        """The one setter of ``state``; an invalid transition is a bug."""
        if state not in _MOVES[self.state]:
            raise AssertionError(f"ticket: {self.state.value} -> {state.value}")
        self.state = state


class Outcome(enum.Enum):
    WAITING = "waiting"  # in the line (the next dispatch may admit it at once)
    FULL = "full"  # refused: the line is full and nobody in it can be shed for it
    SHED = "shed"  # refused: sheddable, and the line is full or the wait too long


@dataclass(frozen=True, slots=True)
class Arrival:
    outcome: Outcome
    evicted: Ticket | None = None  # the sheddable waiter shed to make room for it


@dataclass(slots=True)
class _Band:
    counters: VirtualCounters = field(default_factory=VirtualCounters)
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)  # tenant → its FIFO
    waiting: int = 0


class Scheduler:
    def __init__(self, policy: Policy = Policy.FAIR, max_waiting: int = 64) -> None:
        self.policy = policy
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.waiting = 0
        self._bands: dict[int, _Band] = {}
        self._levels: list[int] = []  # the bands' levels, highest first
        self._seq = itertools.count()

    def configure(self, policy: Policy, max_waiting: int, tenants: set[str]) -> None:
        """New settings; the counters of idle tenants outside ``tenants`` are forgotten."""
        self.policy = policy
        self.max_waiting = max_waiting
        for band in self._bands.values():
            band.counters.forget_idle(tenants)

    # ---- arrivals ----

    def arrive(self, ticket: Ticket, capacity: int, drain: DrainRate, max_wait_s: float) -> Arrival:
        """Puts ``ticket`` in the line, or refuses it (then it is DONE). ``capacity``: the slots
        the model has now; the caller then dispatches."""
        ticket.seq = next(self._seq)
        ticket.ahead = self._ahead(ticket.tenant)
        tenant = ticket.tenant
        busy = self.in_flight + self.waiting >= capacity
        evicted = None
        if busy and self.waiting >= self.max_waiting:
            evicted = None if tenant.sheddable else self._victim(tenant.band)
            if evicted is None:
                ticket.move(TicketState.DONE)
                return Arrival(Outcome.SHED if tenant.sheddable else Outcome.FULL)
            self.withdraw(evicted)
        elif busy and tenant.sheddable and capacity > 0:
            wait = drain.wait_s(ticket.ahead)
            if wait is not None and wait > max_wait_s:
                ticket.move(TicketState.DONE)
                return Arrival(Outcome.SHED)
        ticket.move(TicketState.WAITING)
        self._band(tenant.band).counters.join(tenant.name)
        self._enqueue(ticket, front=False)
        return Arrival(Outcome.WAITING, evicted)

    def admit_now(self, ticket: Ticket) -> None:
        """Admits ``ticket`` without the line: a slot is free and nobody waits, or its model has
        no slot and none is coming (then past the capacity: the request goes on to get the
        answer that says so)."""
        ticket.seq = next(self._seq)
        self._band(ticket.tenant.band).counters.join(ticket.tenant.name)
        self._admit(ticket)

    def _ahead(self, tenant: Tenant) -> int:
        """How many waiting requests go before a new one of ``tenant``: every one in a higher
        band, and in its own band all (fcfs) or, under fair, its tenant's own plus from every
        other tenant as many as it is served meanwhile at their weights' ratio (one round of
        requests per request of its own: requests stand in for tokens)."""
        ahead = sum(self._bands[level].waiting for level in self._levels if level > tenant.band)
        band = self._bands.get(tenant.band)
        if band is None:
            return ahead
        if self.policy is Policy.FCFS:
            return ahead + band.waiting
        own = band.queues.get(tenant.name)
        rounds = (len(own) if own else 0) + 1
        for name, queue in band.queues.items():
            if name == tenant.name:
                ahead += len(queue)
            else:
                share = math.ceil(rounds * queue[0].tenant.weight / tenant.weight)
                ahead += min(len(queue), share)
        return ahead

    def _victim(self, band: int) -> Ticket | None:
        """The most recent sheddable waiter in the lowest band that has one, up to ``band``."""
        for level in reversed(self._levels):
            if level > band:
                return None
            latest = [
                queue[-1]
                for queue in self._bands[level].queues.values()
                if queue[-1].tenant.sheddable
            ]
            if latest:
                return max(latest, key=lambda t: t.seq)
        return None

    # ---- dispatch ----

    def dispatch(self, capacity: int) -> list[Ticket]:
        """Admits waiting requests, in order, while fewer than ``capacity`` are in flight."""
        admitted: list[Ticket] = []
        while self.in_flight < capacity and self.waiting:
            band = next(self._bands[level] for level in self._levels if self._bands[level].waiting)
            ticket = self._pop(band)
            self._admit(ticket)
            admitted.append(ticket)
        return admitted

    def _pop(self, band: _Band) -> Ticket:
        queues = band.queues
        if len(queues) == 1:
            name = next(iter(queues))
        elif self.policy is Policy.FCFS:
            name = min(queues, key=lambda t: queues[t][0].seq)
        else:
            counters = band.counters.counters
            name = min(queues, key=lambda t: (counters[t], queues[t][0].seq))
        queue = queues[name]
        ticket = queue.popleft()
        if not queue:
            del queues[name]
        band.waiting -= 1
        self.waiting -= 1
        return ticket

    def _admit(self, ticket: Ticket) -> None:
        ticket.move(TicketState.ADMITTED)
        self.in_flight += 1
        if not ticket.charged:
            ticket.charged = True
            self.charge(ticket, ticket.prompt_tokens)

    # ---- leaving ----

    def release(self, ticket: Ticket) -> None:
        """An admitted request ended: its slot is free."""
        ticket.move(TicketState.DONE)
        self.in_flight -= 1
        self._bands[ticket.tenant.band].counters.leave(ticket.tenant.name)

    def withdraw(self, ticket: Ticket) -> None:
        """A waiting request leaves the line (refused, shed, timed out, or its client left)."""
        ticket.move(TicketState.DONE)
        band = self._bands[ticket.tenant.band]
        queue = band.queues[ticket.tenant.name]
        queue.remove(ticket)
        if not queue:
            del band.queues[ticket.tenant.name]
        band.waiting -= 1
        self.waiting -= 1
        band.counters.leave(ticket.tenant.name)

    def requeue(self, ticket: Ticket) -> None:
        """An admitted request gives its slot back and waits again, first of its tenant: its
        replica went away under it (a crash, a park) before it was answered."""
        ticket.move(TicketState.WAITING)
        self.in_flight -= 1
        self._enqueue(ticket, front=True)

    # ---- tokens ----

    def charge(self, ticket: Ticket, tokens: float) -> None:
        """Charges ``tokens`` served to ``ticket`` (negative: corrects an estimate)."""
        tenant = ticket.tenant
        self._bands[tenant.band].counters.charge(tenant.name, tokens / tenant.weight)

    def counter(self, tenant: Tenant) -> float:
        """``tenant``'s virtual token counter (0 before its first request)."""
        band = self._bands.get(tenant.band)
        return band.counters.counters.get(tenant.name, 0.0) if band else 0.0

    # ---- bands ----

    def _band(self, level: int) -> _Band:
        band = self._bands.get(level)
        if band is None:
            band = self._bands[level] = _Band()
            self._levels = sorted(self._bands, reverse=True)
        return band

    def _enqueue(self, ticket: Ticket, front: bool) -> None:
        band = self._bands[ticket.tenant.band]
        queue = band.queues.get(ticket.tenant.name)
        if queue is None:
            queue = band.queues[ticket.tenant.name] = deque()
        if front:
            queue.appendleft(ticket)
        else:
            queue.append(ticket)
        band.waiting += 1
        self.waiting += 1
