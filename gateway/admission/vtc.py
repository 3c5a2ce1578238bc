"""The Virtual Token Counter of one priority band (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): a counter per tenant of the tokens it was served, each divided by
its weight; the scheduler serves the tenant with the smallest counter next.

A tenant is *active* while it has requests waiting or in flight. One that becomes active is
lifted to the smallest counter among the active tenants (or, when none is, to the counter of the
last one to go idle), so time spent idle banks no credit: a returning tenant competes from where
the others are, not from where it left off.
"""

from __future__ import annotations

from collections.abc import Iterable


class VirtualCounters:
    __slots__ = ("_active", "_floor", "counters")

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant → its requests waiting or in flight
        self._floor = 0.0  # the counter of the last tenant that left no other active

    def join(self, tenant: str) -> None:
        """One more request of ``tenant`` waiting or in flight; lifts it if it was idle."""
        count = self._active.get(tenant, 0)
        if count == 0:
            level = min((self.counters[t] for t in self._active), default=self._floor)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), level)
        self._active[tenant] = count + 1

    def leave(self, tenant: str) -> None:
        """One request of ``tenant`` is no longer waiting or in flight."""
        count = self._active[tenant] - 1
        if count:
            self._active[tenant] = count
            return
        del self._active[tenant]
        if not self._active:
            self._floor = max(self._floor, self.counters[tenant])

    def charge(self, tenant: str, tokens: float) -> None:
        """``tokens`` already divided by the tenant's weight; negative corrects an overcharge."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def forget_idle(self, keep: Iterable[str]) -> None:
        """Drops the counters of idle tenants not in ``keep`` (keys removed by a reload)."""
        kept = set(keep)
        for tenant in [t for t in self.counters if t not in kept and t not in self._active]:
            del self.counters[tenant]
