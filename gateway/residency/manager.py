"""The residency manager: loads on-demand models at their first request, parks them after
``idle_ttl_s`` without requests, and makes room within the memory budget (plan.py) when a model
must load; requests wait for it in the model's line (gateway/admission, which asks ``supply``
whether a replica is coming), which also covers a model whose replicas are restarting after a
crash. A failed model answers 503 ``model_failed`` until its ``queue.failed_retry_s`` has passed
(the Retry-After it sends), then the next request starts it again, once: the requests that come
meanwhile wait as for any load.

Every eviction (to make room, after the idle TTL, or an operator's park or unload) goes through
``evict``, which counts it and drives the engine pool (``put_to_sleep`` or ``deactivate``; loads
``activate``). The manager hears every replica transition from the pool (``on_transition``),
which refuses the waiting requests of a model that failed, measures footprints and keeps the
metrics in step (a ready replica's slots reach the line through the router). A fleet without local
models has one too, managing no model: nothing is ever coming for its requests, and a reload that
adds local models finds it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from common.errors import RequestRefused
from gateway.admission import AdmissionControl
from gateway.admission.drain import UNMEASURED_RETRY_AFTER_S
from gateway.admission.refusals import unavailable
from gateway.backend import Backend
from gateway.config import FleetConfig, MemoryBudget, ModelConfig
from gateway.engines.pool import EnginePool
from gateway.engines.process import CRASH_NOTICE_S, exits_soon, has_exited
from gateway.engines.replica import Replica, ReplicaState
from gateway.metrics import GatewayMetrics
from gateway.residency.footprint import (
    Footprint,
    estimate,
    machine_ram_bytes,
    measured_bytes,
    measured_growth,
    parked_estimate,
)
from gateway.residency.plan import Eviction, Need, Resident, growth_reserve, plan_room
from gateway.router import ModelRoute, Router

log = logging.getLogger("modelyard.residency")

S = ReplicaState
AWAKE = frozenset({S.STARTING, S.READY, S.WAKING, S.PARKING, S.DRAINING, S.BACKOFF, S.STOPPING})
# A load is under way (or a restart): a ready replica will come without being asked.
COMING = frozenset({S.STARTING, S.WAKING, S.BACKOFF})
# The model states /admin/models and /v1/models show, the first of its replicas' states that
# holds in this order ("stopped" when it has no replica).
_MODEL_STATE_ORDER = (
    S.READY, S.WAKING, S.STARTING, S.BACKOFF, S.PARKING, S.PARKED, S.DRAINING, S.STOPPING, S.FAILED,
)  # fmt: skip
PLAN_RETRY_S = 0.25  # a load waiting for room looks again this often
# Ready replicas are measured again this often: an engine grows as it compiles grammars, which
# the plan reserves room for once, not per model (rule 6 of plan.py)
MEASURE_EVERY_S = 5.0
TEMPLATES = "(engine templates)"  # what the engine templates hold, as a resident of the budget


@dataclass
class ModelResidency:
    config: ModelConfig
    footprint: Footprint
    last_used: float = field(default_factory=time.monotonic)
    # its load under way: None once it serves, else the refusal its waiting requests got
    loading: asyncio.Task[RequestRefused | None] | None = None
    reserved: bool = False  # its load has room: counted awake until it is (or failed)
    unloads: int = 0  # operator unloads so far: a load that saw one did not fail
    retry_at: float = 0.0  # when its last replica failure allows a request to try it again


class ResidencyManager:
    def __init__(
        self,
        pool: EnginePool,
        router: Router,
        metrics: GatewayMetrics,
        config: FleetConfig,
        admission: AdmissionControl,
    ) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.admission = admission  # the models' lines, where their requests wait
        self.models: dict[str, ModelResidency] = {}
        self.budget_bytes = 0
        self.budget_gpu = 0.0
        self.park_evicted = True
        self._sweeper: asyncio.Task[None] | None = None
        self._placement = asyncio.Lock()  # one plan (and its evictions) at a time
        self._outgrown = False  # the last measurement found more resident than the budget
        self._tasks: set[asyncio.Task[object]] = set()
        self.configure(config)

    # ---- configuration and lifecycle ----

    def configure(self, config: FleetConfig) -> None:
        self._set_budget(config.gateway.memory)
        models: dict[str, ModelResidency] = {}
        for model in config.models:
            if not model.local:
                continue
            current = self.models.get(model.name)
            if current is None:
                current = ModelResidency(model, estimate(model))
            elif current.config != model and (
                not current.footprint.measured or current.config.source != model.source
            ):
                current.footprint = estimate(model)
            current.config = model
            models[model.name] = current
            self.metrics.declare_residency(model.name)
        self.models = models

    def _set_budget(self, memory: MemoryBudget) -> None:
        self.budget_bytes = memory.cpu_bytes or int(machine_ram_bytes() * memory.auto_cpu_share)
        self.budget_gpu = memory.gpu_fraction
        self.park_evicted = memory.park
        self.metrics.memory_budget.set(self.budget_bytes)

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        tasks = [t for t in (self._sweeper, *self._tasks) if t is not None]
        for res in self.models.values():
            if res.loading is not None:
                tasks.append(res.loading)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, work: object) -> None:
        task = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests ----

    def touch(self, name: str) -> None:
        """A request for ``name`` arrived or finished: its idle TTL starts again."""
        res = self.models.get(name)
        if res is not None:
            res.last_used = time.monotonic()

    async def supply(self, route: ModelRoute, tried: Collection[Backend]) -> bool:
        """The lines' question when no backend of ``route`` is available besides ``tried``:
        whether a replica is on its way (loading, waking, restarting), starting the load when
        none is; the request then waits in the model's line. False when live replicas are up but
        unavailable or tried (their health and answers decide) or the model is not local; raises
        the 503 of a failed model."""
        res = self.models.get(route.name)
        if res is None:
            return False
        if await self._replicas_up(route.name, tried):
            return False
        states = self.pool.states(route.name)
        trying = res.loading is not None and not res.loading.done()
        if self.model_state(route.name) == "failed" and not trying:
            if time.monotonic() < res.retry_at:
                raise self._failed(res)
            log.info("model %s failed, and its Retry-After has passed: trying again", route.name)
        if not any(s in COMING for s in states):
            self.ensure_loaded(route.name)
        return True

    async def _replicas_up(self, name: str, tried: Collection[Backend]) -> bool:
        """Whether READY replicas are alive (the request's answer is theirs to give). Replicas
        the request already failed on get ``CRASH_NOTICE_S`` to show they died: a connection
        reset comes a moment before the supervisor hears of the exit. One that did die is given
        as long to leave the router (its supervisor hears of the exit at once): until then its
        slots would look free to the requests waiting in the line for the next replica."""
        deadline = time.monotonic() + CRASH_NOTICE_S
        while True:
            ready = [r for r in self.pool.replicas.get(name, []) if r.state is S.READY]
            if not ready:
                return False
            dead = any(has_exited(r.proc) for r in ready)
            if not dead and any(r.backend not in tried for r in ready):
                return True
            if time.monotonic() >= deadline:
                return not dead
            await asyncio.sleep(0.02)

    def _failed(self, res: ModelResidency) -> RequestRefused:
        """The refusal of a failed model: its Retry-After is when a request may try it again."""
        wait_s = res.retry_at - time.monotonic()
        return unavailable(
            "model_failed",
            f"Model '{res.config.name}' failed to start; a request after Retry-After tries it "
            "again, and an operator can see why in /admin/models.",
            max(1, math.ceil(wait_s)),
        )

    def _unloaded(self, name: str) -> RequestRefused:
        return unavailable(
            "model_unloaded",
            f"Model '{name}' was unloaded by an operator while this request waited for it; a "
            "new request loads it again.",
            UNMEASURED_RETRY_AFTER_S,
        )

    async def engine_crashed(self, backend: Backend) -> bool:
        """Whether the engine process behind ``backend`` died, rather than being stopped by the
        pool: the proxy asks after an attempt's connection dropped (quarantine.py). The drop
        comes a moment before the exit shows, hence up to ``CRASH_NOTICE_S`` of looking."""
        replicas = self.pool.replicas.get(backend.model, [])
        replica = next((r for r in replicas if r.backend is backend), None)
        if replica is None:
            return False
        proc = replica.proc  # this one: a restart after its backoff spawns another
        return await exits_soon(proc) and replica.state not in (S.STOPPING, S.STOPPED)

    # ---- loading ----

    def ensure_loaded(self, name: str) -> None:
        """Starts loading (or waking) ``name`` in the background unless that is under way."""
        res = self.models[name]
        if res.loading is None or res.loading.done():
            res.loading = asyncio.create_task(
                self._load(name, lambda: self.admission.waiting(name) > 0)
            )

    async def load(self, name: str) -> None:
        """Loads ``name`` for an operator and waits (for room, up to its queue's max_wait_s);
        raises the refusal waiting requests got when it does not serve."""
        res = self.models[name]
        if res.loading is None or res.loading.done():
            deadline = time.monotonic() + res.config.queue.max_wait_s
            res.loading = asyncio.create_task(self._load(name, lambda: time.monotonic() < deadline))
        refused = await asyncio.shield(res.loading)
        if refused is not None:
            raise refused

    async def _load(self, name: str, wanted: Callable[[], bool]) -> RequestRefused | None:
        res = self.models[name]
        unloads = res.unloads
        try:
            room = await self._make_room(name, wanted)
            ok = room and await self.pool.activate(name)
        finally:
            res.reserved = False
        if ok:
            res.last_used = time.monotonic()
            return None
        if res.unloads != unloads:
            # An unload came first (the pool then starts nothing): nothing failed. It answered
            # the requests it found waiting; those that came since are a new load's.
            if self.admission.waiting(name):
                asyncio.get_running_loop().call_soon(self._load_again, name)
            return self._unloaded(name)
        if room and not any(s in COMING for s in self.pool.states(name)):
            self.admission.refuse(name, lambda: self._failed(res))
        return self._failed(res)

    def _load_again(self, name: str) -> None:
        if name in self.models:
            self.ensure_loaded(name)

    async def _make_room(self, name: str, wanted: Callable[[], bool]) -> bool:
        """Evicts what the plan says until ``name`` fits, then reserves its awake footprint (so
        that loads planned meanwhile count it); False when nobody wants it any more. Plans are
        made one at a time: two loads must not both count the same free memory."""
        res = self.models[name]
        while wanted() and name in self.models:
            async with self._placement:
                evictions = self._plan(name)
                for eviction in evictions or ():
                    await self.evict(eviction, "memory")
                if evictions == []:
                    res.reserved = True
                    return True
            if evictions is None:
                await asyncio.sleep(PLAN_RETRY_S)
        return False

    def _plan(self, name: str) -> list[Eviction] | None:
        """What must go for every replica of ``name`` to be awake (what it holds now, parked,
        is not counted: it is left out of the residents)."""
        target = self.models[name]
        replicas = target.config.replicas
        fp = target.footprint
        need = Need(replicas * fp.awake_bytes, replicas * fp.gpu_fraction, fp.growth_bytes)
        residents = self._residents(but=name)
        evictions = plan_room(
            need, self.budget_bytes, self.budget_gpu, residents, self.park_evicted
        )
        if evictions is None:
            log.info("model %s waits for memory: needs %.0f MiB", name, need.cpu_bytes / 2**20)
        return evictions

    def _residents(self, but: str | None = None) -> list[Resident]:
        """Every model holding memory now, but ``but``; and the engine templates, once (their
        PSS: the engines' PSS carries the rest of the pages they share), never evicted."""
        found = [r for n in self.models if n != but and (r := self._resident(n)) is not None]
        templates = self.pool.templates.pss_bytes()
        if templates:
            found.append(Resident(TEMPLATES, True, templates, templates, 0.0, evictable=False))
        return found

    def _resident(self, name: str) -> Resident | None:
        """The memory ``name`` holds: its awake and parked replicas, or, while its load is under
        way, every replica awake."""
        res = self.models[name]
        states = self.pool.states(name)
        awake = sum(s in AWAKE for s in states)
        parked = states.count(S.PARKED)
        if res.reserved:
            awake, parked = max(res.config.replicas, awake + parked), 0
        if not awake and not parked:
            return None
        fp = res.footprint
        # a parked engine holds no more than an awake one: the parked floor's estimate (the
        # runtime) can exceed a small model's measured awake footprint until it is measured too
        parked_floor = min(fp.parked_bytes, fp.awake_bytes)
        return Resident(
            name=name,
            awake=awake > 0,
            awake_bytes=(awake + parked) * fp.awake_bytes,
            parked_bytes=(awake + parked) * parked_floor,
            gpu_fraction=awake * fp.gpu_fraction,
            evictable=self._evictable(name, states),
            priority=res.config.priority,
            last_used=res.last_used,
            growth_bytes=fp.growth_bytes if awake else 0,
        )

    def _evictable(self, name: str, states: list[ReplicaState]) -> bool:
        res = self.models[name]
        route = self.router.routes.get(name)
        return (
            res.config.on_demand
            and (route is None or route.inflight == 0)
            and self.admission.waiting(name) == 0
            and (res.loading is None or res.loading.done())
            and all(s in (S.READY, S.PARKED) for s in states)
        )

    # ---- evictions and operator actions ----

    async def evict(self, eviction: Eviction, reason: str) -> None:
        """Parks or stops a model to make room (``memory``), after its idle TTL (``idle``) or for
        an operator (``operator``), counted in the evictions metric."""
        log.info("model %s: %s (%s)", eviction.name, eviction.action, reason)
        self.metrics.child(self.metrics.evictions, eviction.name, eviction.action, reason).inc()
        if eviction.action == "park":
            await self.pool.put_to_sleep(eviction.name)
        else:
            await self.pool.deactivate(eviction.name)

    async def unload(self, name: str) -> None:
        """Stops ``name``. The requests waiting for it are answered 503 ``model_unloaded``, and
        a load it interrupts is no failure (``_load``); a later request loads it again."""
        res = self.models[name]
        res.unloads += 1
        self.admission.refuse(name, lambda: self._unloaded(name))
        await self.evict(Eviction(name, "stop"), "operator")

    # ---- idle TTL ----

    async def _sweep(self) -> None:
        measured_at = time.monotonic()
        while True:
            ttls = [r.config.idle_ttl_s for r in self.models.values() if r.config.on_demand]
            await asyncio.sleep(min([1.0, *(t / 4 for t in ttls)]))
            now = time.monotonic()
            if now - measured_at >= MEASURE_EVERY_S:
                measured_at = now
                await self._measure_again()
            for name, res in list(self.models.items()):
                if not res.config.on_demand or now - res.last_used < res.config.idle_ttl_s:
                    continue
                states = self.pool.states(name)
                if S.READY in states and self._evictable(name, states):
                    await self.evict(Eviction(name, self._idle_action(name)), "idle")

    def _idle_action(self, name: str) -> str:
        """Park while everything resident fits with it parked; stop otherwise."""
        if not self.park_evicted:
            return "stop"
        resident = self._resident(name)
        others = self._residents(but=name)
        held = sum(r.held_bytes for r in others) + (resident.parked_bytes if resident else 0)
        return "park" if held + growth_reserve(others) <= self.budget_bytes else "stop"

    async def _measure_again(self) -> None:
        """Every ready replica measured again, then room made (idle models parked or stopped, as
        for a load) where what is resident, and the growth reserved once, no longer fit."""
        for name in list(self.models):
            for replica in list(self.pool.replicas.get(name, ())):
                if replica.state is S.READY:
                    await self._measure(replica, awake=True)
        async with self._placement:
            residents = self._residents()
            evictions = plan_room(
                Need(0), self.budget_bytes, self.budget_gpu, residents, self.park_evicted
            )
            outgrown = evictions is None
            if outgrown and not self._outgrown:
                log.warning("what is resident has outgrown the memory budget; nothing can go")
            self._outgrown = outgrown
            for eviction in evictions or ():
                await self.evict(eviction, "memory")

    # ---- what the pool tells us ----

    def on_transition(self, replica: Replica, old: ReplicaState) -> None:
        """The pool's listener: every replica transition."""
        self.metrics.replica_changed(replica, old)
        res = self.models.get(replica.model)
        if res is None:
            return
        new = replica.state
        if new is S.READY:
            self._spawn(self._measure(replica, awake=True))
        elif new is S.PARKED:
            self._spawn(self._measure(replica, awake=False))
        elif new is S.FAILED:
            res.retry_at = time.monotonic() + res.config.queue.failed_retry_s
            if not any(s in COMING for s in self.pool.states(replica.model)):
                self.admission.refuse(replica.model, lambda: self._failed(res))
        self._report_memory()

    async def _measure(self, replica: Replica, awake: bool) -> None:
        status = await self.pool.client.status(replica.url)
        taken = measured_bytes(status, awake)
        res = self.models.get(replica.model)
        if taken is None or res is None:
            return
        if replica.state is (S.READY if awake else S.PARKED):  # not a state it has left since
            replica.measured_bytes = taken
        fp = res.footprint
        device = status.get("device") if status else None
        if isinstance(device, str) and not device.startswith("cuda"):
            fp.gpu_fraction = 0.0  # device "auto" on a machine without a GPU
        if awake:
            fp.awake_bytes, fp.measured = taken, True
            fp.growth_bytes = measured_growth(status)
            parked = parked_estimate(status)
            if not fp.parked_measured and parked is not None:
                fp.parked_bytes = parked
        else:
            fp.parked_bytes, fp.parked_measured = taken, True
        self._report_memory()

    def _report_memory(self) -> None:
        residents = self._residents()
        self.metrics.memory_resident.set(sum(r.held_bytes for r in residents))
        for name, res in self.models.items():
            self.metrics.child(self.metrics.model_memory, name, "awake").set(
                res.footprint.awake_bytes
            )
            self.metrics.child(self.metrics.model_memory, name, "parked").set(
                res.footprint.parked_bytes
            )

    # ---- what operators and clients see ----

    def model_state(self, name: str) -> str:
        states = self.pool.states(name)
        for state in _MODEL_STATE_ORDER:
            if state in states:
                return state.value
        return S.STOPPED.value

    def describe(self, name: str) -> dict[str, object]:
        res = self.models[name]
        idle_s = time.monotonic() - res.last_used
        resident = self._resident(name)
        return {
            "state": self.model_state(name),
            "residency": res.config.residency,
            "idle_ttl_s": res.config.idle_ttl_s if res.config.on_demand else None,
            "ttl_left_s": self._ttl_left_s(name, idle_s),
            "priority": res.config.priority,
            "idle_s": round(idle_s, 3),
            "resident_bytes": resident.held_bytes if resident else 0,
            "footprint": res.footprint.describe(),
            "replicas": [_replica_info(r) for r in self.pool.replicas.get(name, [])],
        }

    def _ttl_left_s(self, name: str, idle_s: float) -> float | None:
        """Seconds before the idle TTL sweeper parks (or stops) ``name``; None while it would not:
        pinned, not awake, or busy (requests in flight or held, a load under way)."""
        res = self.models[name]
        states = self.pool.states(name)
        if not res.config.on_demand or S.READY not in states or not self._evictable(name, states):
            return None
        return round(max(0.0, res.config.idle_ttl_s - idle_s), 3)

    def load_state(self, name: str) -> str:
        """Where the load of ``name`` stands, for its held requests' refusals: each replica on its
        way (its start-up stage, or waking, or its backoff after a crash)."""
        now = time.monotonic()
        coming = [r for r in self.pool.replicas.get(name, []) if r.state in COMING]
        if not coming:
            res = self.models.get(name)
            loading = res is not None and res.loading is not None and not res.loading.done()
            return "it waits for room in the memory budget" if loading else "no replica is loading"
        states = []
        for replica in coming:
            state = f"replica {replica.index} {replica.state.value} for {now - replica.since:.1f}s"
            if replica.state is S.STARTING and replica.progress is not None:
                state += f", in stage {replica.progress}"
            states.append(state)
        return "; ".join(states)

    def budget(self) -> dict[str, object]:
        residents = self._residents()
        return {
            "cpu_bytes": self.budget_bytes,
            "cpu_resident_bytes": sum(r.held_bytes for r in residents),
            "templates_bytes": sum(r.held_bytes for r in residents if r.name == TEMPLATES),
            "gpu_fraction": self.budget_gpu,
            "gpu_resident_fraction": round(sum(r.held_gpu for r in residents), 4),
        }


def _replica_info(replica: Replica) -> dict[str, object]:
    """The replica as it describes itself, and its requests in flight (its backend's, which it
    keeps while draining or parking)."""
    backend = replica.backend
    in_flight = backend.outstanding if isinstance(backend, Backend) else 0
    return {**replica.describe(), "in_flight": in_flight}
