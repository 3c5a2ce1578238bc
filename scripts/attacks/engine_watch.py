"""The victim's model across an attack, from the gateway's /admin/models every 0.5 s: the
engine PIDs it had (a crash shows as a new one even where the gateway replaced the replica, and
its restart count with it), the states it went through, and at the end: is the engine alive,
the same process, how often the gateway counted a restart, in which state."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from common.processes import alive
from scripts.attacks.fleet import Fleet

WATCH_EVERY_S = 0.5
STATES_SHOWN = 16


class EngineWatch:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.before: dict[str, Any] = {}
        self.pids: list[int] = []
        self.states: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.before = await self._look()
        self._task = asyncio.create_task(self._watch())

    async def _look(self) -> dict[str, Any]:
        status = await asyncio.to_thread(self.fleet.model_status)
        if status["pid"] is not None and status["pid"] not in self.pids:
            self.pids.append(status["pid"])
        if not self.states or self.states[-1] != status["state"]:
            self.states.append(status["state"])
        return status

    async def _watch(self) -> None:
        while True:  # cancelled by figures()
            await asyncio.sleep(WATCH_EVERY_S)
            await self._look()

    async def figures(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return engine_figures(self.before, await self._look(), self.pids, self.states)


def engine_figures(
    before: dict[str, Any], after: dict[str, Any], pids: list[int], states: list[str]
) -> dict[str, Any]:
    counted = None not in (after["restarts"], before["restarts"])
    return {
        "engine_alive_end": after["pid"] is not None and alive(after["pid"]),
        "engine_pid_changed": after["pid"] != before["pid"],
        "engine_pids_seen": len(pids),
        "gateway_restarts": after["restarts"] - before["restarts"] if counted else None,
        "model_states_seen": ">".join(states[:STATES_SHOWN]),
        "model_state_end": after["state"],
    }
