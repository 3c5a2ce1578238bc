"""Counting how many copies of a model are awake at once within a budget, bounded in count and
time. Both loops take their actions as callables, so the counting is tested without servers.

Modelyard: the gateway decides. Copies are loaded one by one (a request each) until the gateway
parks or stops an awake one to make room for the next, or a load fails: the most copies awake at
once is the count. llama-server has no budget of its own: processes are started one by one while
the sum of their resident sets, plus one more of the last one's size, stays within the budget."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

READY = "ready"


def awake(states: dict[str, str]) -> list[str]:
    """The copies serving now (the gateway's model state ``ready``)."""
    return [name for name, state in states.items() if state == READY]


def evicted(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The copies awake before that are not any more (parking, parked, stopping, stopped)."""
    return [name for name in awake(before) if after.get(name) != READY]


@dataclass
class Load:
    ok: bool
    seconds: float
    error: str | None = None


async def fill_gateway(
    load: Callable[[str], Awaitable[Load]],
    states: Callable[[], Awaitable[dict[str, str]]],
    names: list[str],
    max_seconds: float,
) -> dict[str, Any]:
    """Loads ``names`` in order until one evicts another, a load fails, the names run out or
    ``max_seconds`` pass (checked before each load). ``awake_max``: the most awake at once."""
    deadline = time.monotonic() + max_seconds
    steps: list[dict[str, Any]] = []
    stopped_because = "max_copies"
    most = 0
    for name in names:
        if time.monotonic() >= deadline:
            stopped_because = "max_seconds"
            break
        before = await states()
        result = await load(name)
        after = await states()
        out = evicted(before, after)
        most = max(most, len(awake(after)))
        steps.append(
            {"model": name, "ok": result.ok, "seconds": round(result.seconds, 3),
             "error": result.error, "awake": len(awake(after)), "evicted": out}
        )  # fmt: skip
        if not result.ok:
            stopped_because = "load_failed"
            break
        if out:
            stopped_because = "evicted"
            break
    return {"awake_max": most, "stopped_because": stopped_because, "steps": steps}


class Copy(Protocol):
    """A started server process: its resident set once loaded, and how to stop it."""

    rss_bytes: int

    def stop(self) -> object: ...


async def fill_processes(
    start: Callable[[int], Awaitable[Copy]],
    budget_bytes: int,
    max_copies: int,
    max_seconds: float,
) -> tuple[list[Copy], dict[str, Any]]:
    """Starts copies 0, 1 ... while the running ones' RSS plus the last one's again fits in
    ``budget_bytes`` (a copy that turns out larger and passes the budget is stopped and not
    counted), at most ``max_copies``, starting none after ``max_seconds``. Returns the copies
    running (the caller stops them) and how the count ended."""
    deadline = time.monotonic() + max_seconds
    copies: list[Copy] = []
    total = 0
    stopped_because = "max_copies"
    for index in range(max_copies):
        if copies and total + copies[-1].rss_bytes > budget_bytes:
            stopped_because = "budget"
            break
        if time.monotonic() >= deadline:
            stopped_because = "max_seconds"
            break
        try:
            copy = await start(index)
        except (RuntimeError, TimeoutError) as error:
            stopped_because = f"start_failed: {error}"
            break
        if total + copy.rss_bytes > budget_bytes:
            copy.stop()
            stopped_because = "budget"
            break
        copies.append(copy)
        total += copy.rss_bytes
    info = {"count": len(copies), "stopped_because": stopped_because, "rss_sum_bytes": total}
    return copies, info
