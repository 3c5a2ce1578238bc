"""The admission scheduler, pure and step by step: bands, the virtual token counters (charges,
weights, the lift of a tenant returning from idle), fcfs, the line's bound, shedding and eviction,
requeues, and the drain rate behind Retry-After."""

from __future__ import annotations

import pytest

from gateway.admission.drain import DrainRate
from gateway.admission.scheduler import Outcome, Policy, Scheduler, Tenant, Ticket, TicketState
from gateway.admission.vtc import VirtualCounters

A, B, C = Tenant("a"), Tenant("b"), Tenant("c")
NO_RATE = DrainRate()  # never measured: no expected waits


def arrive(
    s: Scheduler, tenant: Tenant, prompt: int = 0, capacity: int = 1, drain: DrainRate = NO_RATE
) -> Ticket:
    ticket = Ticket(tenant, prompt)
    assert s.arrive(ticket, capacity, drain, max_wait_s=10).outcome is Outcome.WAITING
    return ticket


def names(tickets: list[Ticket]) -> list[str]:
    return [t.tenant.name for t in tickets]


def busy(s: Scheduler, tenant: Tenant = A) -> Ticket:
    """One request of ``tenant`` admitted into a capacity of 1."""
    ticket = arrive(s, tenant)
    assert s.dispatch(1) == [ticket]
    return ticket


# ---- order ----


def test_fcfs_admits_in_arrival_order_whatever_the_counters():
    s = Scheduler(Policy.FCFS)
    s.charge(busy(s, A), 1000)  # a is far ahead: fcfs does not care
    waiting = [arrive(s, t) for t in (A, B, A, C)]
    assert s.dispatch(5) == waiting


def test_fair_serves_the_smallest_counter_first_and_each_tenant_in_order():
    s = Scheduler(Policy.FAIR)
    running = busy(s, A)
    s.charge(running, 100)
    b1, b2 = arrive(s, B, prompt=60), arrive(s, B, prompt=60)
    a1, a2 = arrive(s, A), arrive(s, A)
    # b, lifted to a's 100 when it joined (a is active), ties with a: the older request goes
    assert s.dispatch(2) == [b1]
    assert s.counter(A) == 100 and s.counter(B) == 160  # its prompt, charged at admission
    assert s.dispatch(3) == [a1]  # a (100) < b (160), however late it came
    assert s.dispatch(4) == [a2]
    assert s.dispatch(5) == [b2]
    assert s.waiting == 0 and s.in_flight == 5


@pytest.mark.parametrize("policy", list(Policy))
def test_a_higher_band_goes_first_whatever_the_counters_or_arrival(policy):
    vip = Tenant("vip", band=1)
    s = Scheduler(policy)
    busy(s, A)
    low = [arrive(s, A), arrive(s, B)]
    high = arrive(s, vip, prompt=10_000)
    assert s.dispatch(2) == [high]
    assert s.dispatch(4) == low


def test_charges_are_divided_by_the_weight():
    heavy = Tenant("heavy", weight=2)
    s = Scheduler()
    ticket = arrive(s, heavy, prompt=10)
    s.dispatch(1)
    s.charge(ticket, 30)
    assert s.counter(heavy) == 20  # (10 + 30) / 2


def test_weights_two_to_one_share_the_tokens_two_to_one():
    """Two backlogged tenants, equal requests of 10 tokens, one slot: the one of weight 2 is
    served twice as many."""
    heavy, light = Tenant("heavy", weight=2), Tenant("light", weight=1)
    s = Scheduler()
    served = {"heavy": 0, "light": 0}
    for _ in range(3):
        arrive(s, heavy, prompt=10)
        arrive(s, light, prompt=10)
    for _ in range(300):
        (ticket,) = s.dispatch(1)
        served[ticket.tenant.name] += 10
        s.release(ticket)
        arrive(s, ticket.tenant, prompt=10)  # both stay backlogged
    assert abs(served["heavy"] - 2 * served["light"]) <= 20  # within a request of each


def test_vtc_keeps_two_backlogged_tenants_within_its_bound():
    """Sheng et al.'s theorem on a simulated engine: two backlogged tenants, one with requests of
    4 generated tokens and one with 32 (1 prompt token each), 2 slots, one token per slot per
    step. Their service never differs by more than 2U, U = the most a batch holds (2 x 33)."""
    s = Scheduler()
    short, long = Tenant("short"), Tenant("long")
    length = {"short": 4, "long": 32}
    service = {"short": 0, "long": 0}
    left: dict[Ticket, int] = {}
    for tenant in (short, long):
        for _ in range(3):
            arrive(s, tenant, prompt=1, capacity=2)
    bound = 2 * (2 * (1 + 32))
    for _ in range(2000):
        for ticket in s.dispatch(2):
            left[ticket] = length[ticket.tenant.name]
            service[ticket.tenant.name] += 1
        for ticket in list(left):
            s.charge(ticket, 1)
            service[ticket.tenant.name] += 1
            left[ticket] -= 1
            if not left[ticket]:
                del left[ticket]
                s.release(ticket)
                arrive(s, ticket.tenant, prompt=1, capacity=2)
        assert abs(service["short"] - service["long"]) <= bound
    assert min(service.values()) > 1500  # both were served all along


# ---- the lift of a tenant returning from idle ----


def test_a_returning_tenant_is_lifted_to_the_smallest_active_counter():
    s = Scheduler()
    a = busy(s, A)
    s.charge(a, 500)  # a served 500 while b was away
    ticket = arrive(s, B)
    assert s.counter(B) == 500  # no banked credit: it competes from where a is
    s.release(a)
    assert s.dispatch(1) == [ticket]


def test_a_tenant_with_requests_in_flight_is_active():
    s = Scheduler()
    a = busy(s, A)
    s.charge(a, 50)
    arrive(s, B)  # lifted to a's 50: a is active while its request is in flight
    assert s.counter(B) == 50
    s.charge(a, 100)
    arrive(s, B)  # b is active already: not lifted again
    assert s.counter(B) == 50


def test_with_nobody_active_a_returning_tenant_is_lifted_to_the_last_one_to_leave():
    s = Scheduler()
    a = busy(s, A)
    s.charge(a, 70)
    s.release(a)  # a left last, at 70
    arrive(s, B)
    assert s.counter(B) == 70


def test_counters_never_go_down_by_a_lift():
    counters = VirtualCounters()
    counters.join("a")
    counters.charge("a", 10)
    counters.join("b")
    counters.charge("b", 90)
    counters.leave("b")
    counters.join("b")
    assert counters.counters == {"a": 10, "b": 100}  # lifted to 10, then served 90


# ---- bound, shedding, eviction ----


def test_a_full_line_refuses_and_charges_nobody():
    s = Scheduler(max_waiting=1)
    busy(s, A)
    arrive(s, A)
    refused = Ticket(B, prompt_tokens=50)
    assert s.arrive(refused, 1, NO_RATE, 10).outcome is Outcome.FULL
    assert refused.state is TicketState.DONE and s.counter(B) == 0 and s.waiting == 1


def test_a_sheddable_arrival_at_a_full_line_is_shed():
    s = Scheduler(max_waiting=1)
    busy(s, A)
    arrive(s, A)
    assert s.arrive(Ticket(Tenant("x", sheddable=True), 0), 1, NO_RATE, 10).outcome is Outcome.SHED


def test_an_arrival_that_finds_a_free_slot_is_never_refused():
    s = Scheduler(max_waiting=0)
    ticket = arrive(s, Tenant("x", sheddable=True), capacity=1)
    assert s.dispatch(1) == [ticket]


def test_a_non_sheddable_arrival_evicts_the_most_recent_sheddable_waiter():
    batch, vip = Tenant("batch", sheddable=True), Tenant("vip", band=1, sheddable=True)
    s = Scheduler(max_waiting=4)
    busy(s, A)
    older, newer = arrive(s, batch), arrive(s, batch)
    high = arrive(s, vip)  # sheddable, but in a higher band than the arrival below
    a = arrive(s, A)
    b = Ticket(B, 0)
    arrival = s.arrive(b, 1, NO_RATE, 10)
    assert arrival.outcome is Outcome.WAITING and arrival.evicted is newer
    assert newer.state is TicketState.DONE and s.waiting == 4
    assert s.dispatch(5) == [high, older, a, b]


def test_no_eviction_from_a_higher_band():
    vip = Tenant("vip", band=1, sheddable=True)
    s = Scheduler(max_waiting=1)
    busy(s, A)
    arrive(s, vip)
    assert s.arrive(Ticket(B, 0), 1, NO_RATE, 10).outcome is Outcome.FULL


def rate(per_s: float) -> DrainRate:
    """A drain rate measured at ``per_s`` completions per second."""
    drain = DrainRate()
    drain.started(0.0)
    drain.completed(1 / per_s, idle=False)
    assert drain.per_s == pytest.approx(per_s)
    return drain


def test_a_sheddable_arrival_is_shed_when_its_expected_wait_exceeds_max_wait():
    batch = Tenant("batch", sheddable=True)
    s = Scheduler(Policy.FCFS)
    busy(s, A)
    for _ in range(4):
        arrive(s, A)
    # 4 ahead at 1 completion/s: it would wait 5 s
    assert s.arrive(Ticket(batch, 0), 1, rate(1.0), max_wait_s=4.9).outcome is Outcome.SHED
    assert s.arrive(Ticket(batch, 0), 1, rate(1.0), max_wait_s=5.1).outcome is Outcome.WAITING
    assert s.arrive(Ticket(A, 0), 1, rate(0.1), max_wait_s=1).outcome is Outcome.WAITING
    # while the model loads (no slot at all) the drain says nothing: it waits
    assert s.arrive(Ticket(batch, 0), 0, rate(0.1), max_wait_s=1).outcome is Outcome.WAITING


# ---- positions ----


def test_the_requests_ahead_at_arrival():
    s = Scheduler(Policy.FCFS)
    busy(s, A)
    arrive(s, Tenant("vip", band=1))
    arrive(s, A)
    arrive(s, B)
    assert arrive(s, C).ahead == 3
    s.configure(Policy.FAIR, 64, {"a", "b", "c"})
    # fair: its own 0, and one round of each other tenant in or above its band
    heavy = Tenant("heavy", weight=2)
    for _ in range(3):
        arrive(s, heavy)
    assert arrive(s, Tenant("d")).ahead == 1 + 1 + 1 + 1 + 2  # vip, a, b, c, heavy's two


# ---- leaving and coming back ----


def test_requeued_goes_first_of_its_tenant_past_the_bound_charged_once():
    s = Scheduler(max_waiting=1)
    first = arrive(s, A, prompt=10)
    assert s.dispatch(1) == [first]
    later = arrive(s, A, prompt=10)
    s.requeue(first)  # its replica went away under it
    assert s.waiting == 2 and s.in_flight == 0 and later.state is TicketState.WAITING
    assert s.dispatch(1) == [first]
    assert s.counter(A) == 10  # its prompt, once


def test_withdraw_and_release_end_a_ticket_and_make_its_tenant_idle():
    s = Scheduler()
    a = busy(s, A)
    waiting = arrive(s, A)
    s.withdraw(waiting)
    s.charge(a, 5)
    s.release(a)
    assert (s.waiting, s.in_flight) == (0, 0)
    assert waiting.state is a.state is TicketState.DONE
    arrive(s, B)
    assert s.counter(B) == 5  # a left last, at 5
    s.charge(a, 3)  # a correction after the release still counts
    assert s.counter(A) == 8


def test_a_ticket_moves_only_along_its_lifecycle():
    s = Scheduler()
    ticket = busy(s, A)
    s.release(ticket)
    with pytest.raises(AssertionError, match="done -> waiting"):
        s.requeue(ticket)


def test_configure_forgets_idle_tenants_no_longer_configured():
    s = Scheduler()
    a = busy(s, A)
    b = arrive(s, B)
    s.charge(a, 5)
    s.release(a)
    s.configure(Policy.FAIR, 64, {"b"})
    assert s.counter(A) == 0  # idle and no longer configured: forgotten
    assert s.dispatch(1) == [b]


# ---- drain rate and Retry-After ----


def test_drain_rate_counts_busy_time_only():
    drain = DrainRate()
    assert drain.per_s is None and drain.retry_after_s(10) == 5  # unmeasured: the default
    drain.started(100.0)
    drain.completed(100.5, idle=True)  # 2/s
    drain.started(500.0)  # idle in between: not counted
    drain.completed(500.5, idle=False)
    assert drain.per_s == pytest.approx(2.0)
    drain.completed(500.75, idle=False)  # one interval of 0.25 s, smoothed in
    assert 2.0 < drain.per_s < 4.0


def test_retry_after_is_the_work_ahead_over_the_drain_rate():
    assert rate(2.0).retry_after_s(ahead=9) == 5  # 10 completions at 2/s
    assert rate(2.0).retry_after_s(ahead=0) == 1  # at least 1 s
    assert rate(0.3).retry_after_s(ahead=1) == 7  # 2 / 0.3 = 6.7, rounded up
