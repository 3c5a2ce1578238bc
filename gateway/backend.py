"""One upstream server of one model, and its place in rotation as an explicit state machine.

A backend takes new requests (is *available*) when no :class:`Condition` holds. Each condition is
set and cleared by one policy, through the one setter :meth:`Backend.set_condition`:

============  =======================================  =========================================
condition     set by                                   cleared by
============  =======================================  =========================================
UNHEALTHY     failing active checks (health.py)        passing active checks (health.py)
EJECTED       passive evidence (health.py)             a passing check after the ejection time
DRAINING      ``/admin/drain`` (admin.py)              ``/admin/drain`` with ``drain: false``
REMOVED       the router, when its URL leaves the      never: a removed backend is gone for
              fleet (router.py)                        good (its URL may return as a new one)
============  =======================================  =========================================

Transition rules (:meth:`BackendState.with_condition`): nothing changes once REMOVED holds, and
setting a condition that holds (or clearing one that does not) is no transition. Every
transition is reported to the backend's listener, which keeps the Prometheus series in step
(``GatewayMetrics.backend_changed``); a refused one reports nothing, so a late check result
cannot bring back the series of a removed backend.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit


class Condition(enum.Enum):
    """A reason a backend takes no new requests."""

    UNHEALTHY = "unhealthy"
    EJECTED = "ejected"
    DRAINING = "draining"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class BackendState:
    """The conditions that hold; available when there are none. A new backend is optimistically
    available: its first active check runs at once and decides alone."""

    conditions: frozenset[Condition] = frozenset()

    @property
    def available(self) -> bool:
        return not self.conditions

    def __contains__(self, condition: Condition) -> bool:
        return condition in self.conditions

    def with_condition(self, condition: Condition, held: bool) -> BackendState | None:
        """The state after setting (``held``) or clearing ``condition``; None where that is no
        allowed transition."""
        if Condition.REMOVED in self.conditions or (condition in self.conditions) == held:
            return None
        changed = self.conditions | {condition} if held else self.conditions - {condition}
        return BackendState(frozenset(changed))


# Called with the backend (in its new state) and the state before: after every transition, and
# once with None when the backend is created.
StateListener = Callable[["Backend", "BackendState | None"], None]


def _ignore(backend: Backend, before: BackendState | None) -> None:
    pass


class Waiter(Protocol):
    """A request waiting on a backend's answer (the proxy's Exchange): if passive detection
    ejects the backend meanwhile, its task is cancelled and the proxy retries elsewhere."""

    task: asyncio.Task[Any] | None
    evicted_from: Backend | None


class Backend:
    """One upstream server of one model, with the state that routing and health checks share."""

    __slots__ = (
        "_available",
        "_listener",
        "_state",
        "check_fail_streak",
        "check_ok_streak",
        "consecutive_failures",
        "ejected_until",
        "ejection_count",
        "failure_signatures",
        "label",
        "last_readmit",
        "model",
        "outstanding",
        "repeated_failures",
        "url",
        "url_bytes",
        "waiting",
    )

    def __init__(self, model: str, url: str, listener: StateListener | None = None) -> None:
        self.model = model
        self.url = url
        self.url_bytes = url.encode()
        # Bounded (one per configured backend) and without any user:password@ of the URL.
        parts = urlsplit(url)
        self.label = parts.netloc.rpartition("@")[2] + parts.path
        self.outstanding = 0
        self.waiting: set[Waiter] = set()  # attempts here that sent the client nothing yet
        self._state = BackendState()
        self._available = True  # the state's, kept as a plain slot for the router's hot path
        self._listener = listener or _ignore
        # Health bookkeeping (health.py). Active checks: passes and failures in a row.
        self.check_ok_streak = 0
        self.check_fail_streak = 0
        # Passive ejection: failures that count toward ejection, the signatures of the
        # upstream's own error answers among them, and answers that repeated one of those
        # signatures (counted only toward an active check); then the ejections themselves.
        self.consecutive_failures = 0
        self.failure_signatures: set[int] = set()
        self.repeated_failures = 0
        self.ejection_count = 0
        self.ejected_until = 0.0
        self.last_readmit = 0.0
        self._listener(self, None)

    # ---- state: read here, changed only by set_condition ----

    @property
    def state(self) -> BackendState:
        return self._state

    @property
    def available(self) -> bool:
        return self._available

    @property
    def healthy(self) -> bool:
        return Condition.UNHEALTHY not in self._state

    @property
    def ejected(self) -> bool:
        return Condition.EJECTED in self._state

    @property
    def draining(self) -> bool:
        return Condition.DRAINING in self._state

    @property
    def removed(self) -> bool:
        return Condition.REMOVED in self._state

    def set_condition(self, condition: Condition, held: bool = True) -> bool:
        """Sets (or clears) one condition and reports the transition; False when the rules allow
        none (see :meth:`BackendState.with_condition`), and then nothing changes."""
        before = self._state
        after = before.with_condition(condition, held)
        if after is None:
            return False
        self._state = after
        self._available = after.available
        self._listener(self, before)
        return True

    # ---- passive failure streak ----

    def clear_failures(self) -> None:
        """Ends the passive failure streak."""
        self.consecutive_failures = 0
        self.repeated_failures = 0
        self.failure_signatures.clear()

    def describe(self) -> dict[str, Any]:
        """What ``/admin/backends`` shows."""
        return {
            "url": self.url,
            "available": self.available,
            "healthy": self.healthy,
            "ejected": self.ejected,
            "ejection_count": self.ejection_count,
            "draining": self.draining,
            "outstanding": self.outstanding,
            "consecutive_failures": self.consecutive_failures,
        }
