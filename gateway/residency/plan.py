"""What must make room for a model to load or wake, within the memory budget (pure).

Rules, in order:
1. Only an *evictable* model makes room: on demand, no request in flight or held, not loading.
   Pinned models and busy ones never do; when they fill the budget, the load waits.
2. Among evictable models, the lowest ``priority`` goes first, then the least recently used.
3. Parking comes before stopping: idle awake models are parked (a wake later costs a weight
   copy) until the newcomer fits, unless parking one would free nothing (its parked floor, still
   an estimate, no smaller than its measured awake footprint); only if every evictable awake
   model is parked and it still does not fit are parked models stopped (a cold start later), in
   the same order. A model that would be parked and then stopped is just stopped.
4. If evicting every evictable model would not make room, nothing is evicted: the plan is None.
5. With parking off (``gateway.memory.park: false``), every eviction is a stop.
6. What structured outputs may still add to an awake model (``growth_bytes``: grammar cache room,
   compile workers, the grammar vocabulary) is reserved once, the largest among the models awake
   after the plan and the newcomer, not once each: most models never compile a grammar, and
   what one does compile is in its measured memory at the manager's next measurement, which
   makes room again (gateway/residency/manager.py) before another's growth can be counted on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Resident:
    """A model holding memory now (every replica together)."""

    name: str
    awake: bool  # else parked
    awake_bytes: int
    parked_bytes: int
    gpu_fraction: float  # while awake
    evictable: bool
    priority: int = 0
    last_used: float = 0.0
    growth_bytes: int = 0  # while awake: what structured outputs may still add (rule 6)

    @property
    def held_bytes(self) -> int:
        return self.awake_bytes if self.awake else self.parked_bytes

    @property
    def held_gpu(self) -> float:
        return self.gpu_fraction if self.awake else 0.0


@dataclass(frozen=True)
class Eviction:
    name: str
    action: Literal["park", "stop"]


@dataclass(frozen=True)
class Need:
    """What the newcomer adds when it is awake (beyond what it holds now, if parked)."""

    cpu_bytes: int
    gpu_fraction: float = 0.0
    growth_bytes: int = 0  # rule 6


def growth_reserve(residents: list[Resident], need: Need | None = None) -> int:
    """What rule 6 reserves for structured outputs' growth: the largest among the awake
    ``residents`` and the newcomer's ``need``."""
    growth = (r.growth_bytes for r in residents if r.awake)
    return max(need.growth_bytes if need else 0, *growth, 0)


def plan_room(
    need: Need,
    budget_bytes: int,
    budget_gpu: float,
    residents: list[Resident],
    park: bool = True,
) -> list[Eviction] | None:
    """The evictions that make ``need`` fit beside ``residents`` (empty: it fits already)."""
    cpu = sum(r.held_bytes for r in residents) + need.cpu_bytes
    gpu = sum(r.held_gpu for r in residents) + need.gpu_fraction
    actions: dict[str, Literal["park", "stop"]] = {}

    def fits() -> bool:
        growth = growth_reserve([r for r in residents if r.name not in actions], need)
        return cpu + growth <= budget_bytes and gpu <= budget_gpu + 1e-9

    order = sorted((r for r in residents if r.evictable), key=lambda r: (r.priority, r.last_used))
    for r in order if park else ():
        if fits():
            break
        if r.awake and r.parked_bytes < r.awake_bytes:  # else parking would free nothing
            actions[r.name] = "park"
            cpu -= r.awake_bytes - r.parked_bytes
            gpu -= r.gpu_fraction
    for r in order:
        if fits():
            break
        cpu -= r.parked_bytes if r.name in actions or not r.awake else r.awake_bytes
        gpu -= 0.0 if r.name in actions else r.held_gpu
        actions[r.name] = "stop"
    if not fits():
        return None
    return [Eviction(name, action) for name, action in actions.items()]
