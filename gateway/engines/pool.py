"""The engine pool: the engine processes of every local model (``source:``), each replica's
lifecycle driven through its state machine (gateway/engines/replica.py).

Each replica runs ``python -m engine --model SRC --served-model-name NAME --host 127.0.0.1 --port N
...`` on a free loopback port, forked from the engine template of its OpenMP wait policy
(gateway/engines/template.py) or, without one, exec'd. It joins the router when it becomes READY;
if its process exits unexpectedly it leaves the router and restarts after an exponential backoff
(BACKOFF, reset once it has served ``STABLE_AFTER_S``). Only starts that die before READY count
towards giving up (FAILED, with its last log lines), and how they died decides how soon: an engine
that exits by itself before it was ever ready has a config problem (a bad path, a bad flag) and is
FAILED at once; restarts of one that served before, after ``MAX_CRASHES`` such exits since it was
last ready; starts killed by a signal (the OOM killer on a host packed to its budget, a SIGSEGV, a
kill -9), which say more about the host than the config, after ``MAX_KILLED_STARTS``. A FAILED
model is tried again by the residency manager (its first request after the Retry-After), an
operator's load or a reload. Crashes while serving, or while waking, never fail it: a request can
cause the former (gateway/proxy/quarantine.py), and one must not take the model down for everyone.

A model is *active* when its replicas should serve: pinned models always, on-demand ones while the
residency manager (gateway/residency) wants them. ``activate`` wakes parked replicas or starts
them, ``put_to_sleep`` parks them (the process stays, its memory goes), ``deactivate`` stops
them.

Config changes are applied without dropping requests, one replica at a time: start a new replica,
wait for it to be ready, add it to the router, take an old one out of the router, let its in-flight
requests finish (up to ``drain_timeout_s``), then stop it. If a new replica never becomes ready the
rollout stops there and the old replicas keep serving. A GPU replica whose memory fraction does not
fit next to the running ones (a full card) is replaced the other way round: the old one drains and
stops first, so the model serves with one replica fewer meanwhile (none, if it has only one); if the
new one never becomes ready, the old one is started again and the rollout stops. An inactive
model's stale replicas are only stopped: it starts anew at its next activation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Callable

from common.net import free_port
from gateway.backend import Backend
from gateway.config import MAX_GPU_FRACTION_SUM, FleetConfig, ModelConfig
from gateway.engines.logs import EngineLogs
from gateway.engines.process import (
    ENGINE_LAUNCHER,
    EngineClient,
    EngineProcess,
    die_with_gateway,
    engine_command,
    exit_reason,
    exits_soon,
    relay_output,
    send_signal,
    spawn,
    spec_of,
)
from gateway.engines.progress import BETWEEN_PHASES, LoadProgress, reported_progress
from gateway.engines.replica import LEAVING, Replica, ReplicaListener, ReplicaState
from gateway.engines.template import EngineTemplates, ForkedEngine

log = logging.getLogger("modelyard.pool")

S = ReplicaState
READY_POLL_S = 0.25
PROGRESS_POLL_S = 0.5  # a starting engine's /status, for its start-up stage
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
STABLE_AFTER_S = 60.0  # a replica that served this long without crashing resets its backoff
# A replica is FAILED after this many starts, since it was last ready, died before READY:
MAX_CRASHES = 5  # exited by themselves (a replica that was never ready: at the first)
# killed by a signal. More, as an OOM kill depends on what else runs, which changes within
# minutes (idle models park): with the backoff doubling from 1 s to 60 s, 10 starts span ~4 min.
MAX_KILLED_STARTS = 10
SLEEP_TIMEOUT_S = 120.0  # for POST /sleep and /wake_up (a weight copy, not a load)
RECENT_ERRORS = 20  # the replica failures /admin/models lists


class EnginePool:
    """Owns the engine processes; tells the router which URLs serve each local model."""

    def __init__(
        self,
        publish: Callable[[str, list[str]], None],
        find_backend: Callable[[str, str], Backend | None],
        logs: EngineLogs,
        *,
        launcher: tuple[str, ...] = ENGINE_LAUNCHER,
        startup_timeout_s: float = 900.0,
        drain_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
        cwd: str | None = None,
        on_transition: ReplicaListener | None = None,
    ) -> None:
        self.publish = publish  # (model, ready URLs) → router
        self.find_backend = find_backend  # (model, url) → its router Backend, for draining
        self.logs = logs  # each replica's output file
        self.launcher = launcher
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.cwd = cwd
        self.on_transition = on_transition  # metrics and the residency manager
        self.replicas: dict[str, list[Replica]] = {}
        self.models: dict[str, ModelConfig] = {}
        self.active: set[str] = set()  # models whose replicas should serve
        self.client = EngineClient()
        # forks `python -m engine` (ENGINE_LAUNCHER) only
        self.templates = EngineTemplates(cwd, logs)
        # the latest transitions to BACKOFF or FAILED, and sleeps refused, for /admin/models
        self.recent_errors: deque[dict[str, object]] = deque(maxlen=RECENT_ERRORS)
        self._apply_lock = asyncio.Lock()
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._rollouts: set[asyncio.Task[None]] = set()

    # ---- lifecycle ----

    async def apply(self, config: FleetConfig) -> None:
        """Brings the running replicas in line with ``config`` (serialised across calls)."""
        async with self._apply_lock:
            wanted = {m.name: m for m in config.models if m.local}
            removed = [name for name in self.replicas if name not in wanted]
            await asyncio.gather(*(self._remove_model(name) for name in removed))
            self.models = wanted
            for model in wanted.values():
                if not model.on_demand:
                    self.active.add(model.name)
            self.active &= set(wanted)
            ahead: dict[bool, list[list[str]]] = {}
            for model in wanted.values():  # started on their first request: prepared for
                if model.on_demand:
                    ahead.setdefault(model.spin_wait, []).append(engine_command(model, 0, ()))
            self.templates.configure(
                config.gateway.engine_template and self.launcher == ENGINE_LAUNCHER,
                {m.spin_wait for m in wanted.values()},
                ahead,
            )
            await asyncio.gather(*(self._converge_locked(m.name) for m in wanted.values()))

    def apply_soon(self, config: FleetConfig) -> None:
        """For config listeners, which cannot wait: applies in the background."""
        self._background(self.apply(config), "applying the engine pool config")

    async def stop(self) -> None:
        for task in list(self._rollouts):
            task.cancel()
        async with self._apply_lock:
            await asyncio.gather(*(self._remove_model(name) for name in list(self.replicas)))
        await self.templates.stop()  # after the engines: theirs die with them
        await self.client.close()

    async def _remove_model(self, name: str) -> None:
        async with self._lock(name):
            await self._retire(name, list(self.replicas.get(name, [])))
            self.replicas.pop(name, None)
            self.active.discard(name)
            self.publish(name, [])

    def _background(self, work: object, what: str) -> None:
        async def logged() -> None:
            try:
                await work  # type: ignore[misc]
            except Exception:
                log.exception("%s failed", what)

        task = asyncio.create_task(logged())
        self._rollouts.add(task)
        task.add_done_callback(self._rollouts.discard)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._model_locks.setdefault(name, asyncio.Lock())

    # ---- residency: what the manager asks for ----

    async def activate(self, name: str) -> bool:
        """Makes ``name`` serve: wakes its parked replicas, starts missing ones; True when at least
        one replica is READY at the end."""
        model = self.models.get(name)
        if model is None:
            return False
        self.active.add(name)
        async with self._lock(name):
            parked = [r for r in self.replicas.get(name, []) if r.state is S.PARKED]
            await asyncio.gather(*(self._wake(r) for r in parked))
            await self._converge(name)
        return any(r.state is S.READY for r in self.replicas.get(name, []))

    async def put_to_sleep(self, name: str) -> None:
        """Parks every READY replica of ``name`` (one that refuses to sleep stays READY)."""
        self.active.discard(name)
        async with self._lock(name):
            ready = [r for r in self.replicas.get(name, []) if r.state is S.READY]
            await asyncio.gather(*(self._sleep(r) for r in ready))

    async def deactivate(self, name: str) -> None:
        """Stops every replica of ``name`` (drained first)."""
        self.active.discard(name)
        async with self._lock(name):
            await self._retire(name, list(self.replicas.get(name, [])))

    def states(self, name: str) -> list[ReplicaState]:
        return [r.state for r in self.replicas.get(name, [])]

    async def _sleep(self, replica: Replica) -> None:
        replica.set_state(S.PARKING)  # out of the router
        await self._drain(replica)
        status, body = await self.client.post(replica.url, "/sleep?level=1", SLEEP_TIMEOUT_S)
        if replica.state is not S.PARKING:  # crashed or stopped meanwhile
            return
        if status != 200:
            log.warning("replica %s#%d would not sleep (%s): %s", replica.model, replica.index,
                        status, body)  # fmt: skip
            replica.set_state(S.READY, f"sleep refused: {status}")
            return
        replica.set_state(S.PARKED)

    async def _wake(self, replica: Replica) -> bool:
        replica.set_state(S.WAKING)
        status, body = await self.client.post(replica.url, "/wake_up", SLEEP_TIMEOUT_S)
        if replica.state is not S.WAKING:
            return False
        if status == 200 and await self._wait_ready(replica, S.WAKING):
            replica.set_state(S.READY)
            return True
        if await exits_soon(replica.proc):
            return False  # died waking (the OOM killer, a crash): its supervisor restarts it
        log.error("replica %s#%d did not wake (%s): %s", replica.model, replica.index, status, body)
        await self._stop_replica(replica)
        return False

    # ---- convergence ----

    async def _converge_locked(self, name: str) -> None:
        async with self._lock(name):
            await self._converge(name)

    async def _converge(self, name: str) -> None:
        """Replaces stale replicas and matches the replica count (active models), or stops the
        stale ones (inactive models). The caller holds the model's lock."""
        model = self.models[name]
        spec = spec_of(model)
        current = self.replicas.setdefault(name, [])
        gone = [r for r in current if r.state in (S.FAILED, S.STOPPED)]
        if gone:
            await self._retire(name, gone)
        stale = [r for r in self.replicas[name] if r.spec != spec]
        for replica in self.replicas[name]:
            if replica.spec == spec:  # stale ones keep theirs: what they run (and restart with)
                replica.config = model
        if name not in self.active:
            if stale:
                await self._retire(name, stale)
            return
        # Replace stale replicas one at a time: new one up first, then the old one out; on a GPU
        # without room for both, the old one out first.
        for old in stale:
            if self._gpu_in_use() + model.gpu_share > MAX_GPU_FRACTION_SUM:
                log.info("model %s: no GPU memory for a new replica beside the old", name)
                await self._retire(name, [old])
                if not await self._add_replica(model, spec):
                    log.error("model %s: new replica did not become ready; restarting the old one",
                              name)  # fmt: skip
                    await self._add_replica(old.config, old.spec)
                    return
                continue
            if not await self._add_replica(model, spec):
                log.error("model %s: new replica did not become ready; keeping the old ones", name)
                return
            await self._retire(name, [old])
        # Scaling down keeps first the replicas whose spin-wait suits the fleet as it will be: a
        # spinner left from a lone start is kept when the model is back to one replica (fast
        # again), and goes first otherwise.
        fresh = sorted(
            (r for r in self.replicas[name] if r.spec == spec),
            key=lambda r: r.spin_wait != model.spin_wait,
        )
        for _ in range(model.replicas - len(fresh)):
            if not await self._add_replica(model, spec):
                log.error("model %s: replica did not become ready", name)
                return
        surplus = fresh[model.replicas :]
        if surplus:
            await self._retire(name, surplus)

    def _gpu_in_use(self) -> float:
        """The GPU memory fraction of every replica awake (parked ones hold no KV pools)."""
        return sum(
            r.config.gpu_share
            for rs in self.replicas.values()
            for r in rs
            if r.state not in (S.PARKED, S.STOPPED, S.FAILED)
        )

    async def _add_replica(self, model: ModelConfig, spec: tuple[str, ...]) -> bool:
        """Starts a replica and waits until it is READY (True) or has failed (False: it stays,
        FAILED, when it is the model's only one, so that its log lines can be seen)."""
        taken = {r.index for r in self.replicas[model.name]}
        index = next(i for i in range(len(taken) + 1) if i not in taken)  # bounded metric label
        replica = Replica(model.name, spec, model, self._transition, index=index)
        replica.log = self.logs.replica(model.name, index)
        self.replicas[model.name].append(replica)
        replica.supervisor = asyncio.create_task(self._supervise(replica))
        while replica.state not in (S.READY, S.FAILED) and not replica.supervisor.done():
            await replica.wait_change(1.0)
        if replica.state is S.READY:
            return True
        others = [r for r in self.replicas[model.name] if r is not replica]
        if any(r.state not in LEAVING for r in others):
            await self._retire(model.name, [replica])
        return False

    async def _retire(self, model: str, replicas: list[Replica]) -> None:
        """Out of the router first, then drain, then stop."""
        for replica in replicas:
            if replica.state in (S.READY, S.PARKING, S.WAKING):
                replica.set_state(S.DRAINING if replica.state is S.READY else S.STOPPING)
        await asyncio.gather(*(self._drain(r) for r in replicas))
        await asyncio.gather(*(self._stop_replica(r) for r in replicas))
        remaining = [r for r in self.replicas.get(model, []) if r not in replicas]
        if model in self.replicas:
            self.replicas[model] = remaining

    async def _drain(self, replica: Replica) -> None:
        """Waits (up to drain_timeout_s) for the replica's in-flight requests to finish."""
        backend = replica.backend
        if not isinstance(backend, Backend):
            return
        deadline = time.monotonic() + self.drain_timeout_s
        while backend.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _transition(self, replica: Replica, old: ReplicaState) -> None:
        if replica.state in (S.BACKOFF, S.FAILED) or (old, replica.state) == (S.PARKING, S.READY):
            self.recent_errors.append({
                "time": round(time.time(), 3), "model": replica.model, "replica": replica.index,
                "from": old.value, "to": replica.state.value, "reason": replica.reason,
            })  # fmt: skip
        if S.READY in (old, replica.state):
            self.publish(replica.model, [
                r.url for r in self.replicas.get(replica.model, []) if r.state is S.READY
            ])  # fmt: skip
        if replica.state is S.READY:
            # Kept so that draining can count its in-flight requests even after the router
            # dropped it (say, because its model left the config). Taken anew at every READY: a
            # woken replica's URL comes back to the router as a new backend.
            replica.backend = self.find_backend(replica.model, replica.url)
        if self.on_transition is not None:
            self.on_transition(replica, old)

    # ---- one replica ----

    async def _supervise(self, replica: Replica) -> None:
        """Start, wait for /ready, watch; restart with backoff after an unexpected exit, or give
        up (FAILED) when its starts keep dying before READY (the module's docstring says when)."""
        backoff = BACKOFF_BASE_S
        served = False  # some start of it became ready: its config works
        # starts since it was last ready that died before READY: by themselves / by a signal
        exits = kills = 0
        assert replica.log is not None
        while True:
            replica.port = free_port()
            # Spin-wait is decided here, at every start, from the fleet as configured now
            # (replica.config follows reloads); a running engine keeps what it started with.
            replica.spin_wait = replica.config.spin_wait
            try:
                replica.proc = await self._start_engine(replica)
                replica.started_at = time.monotonic()
            except OSError as exc:
                replica.log.write(_marker(f"cannot start the engine: {exc}"))
                replica.set_state(S.STARTING)
                replica.set_state(S.FAILED, str(exc))
                return
            replica.backend = None
            pid = replica.proc.pid
            started = f"pid {pid} {_how_started(replica.proc)} on port {replica.port}"
            replica.log.write(_marker(f"engine {started}"))
            replica.progress = LoadProgress()
            replica.set_state(S.STARTING, f"{started}; log {replica.log.path}")
            output = asyncio.create_task(relay_output(replica.proc, replica.log))
            watch = asyncio.create_task(self._watch_load(replica))
            ready_at: float | None = None
            timed_out = False
            became_ready = await self._wait_ready(replica, S.STARTING)
            watch.cancel()
            if became_ready:
                ready_at = time.monotonic()
                served = True
                took = time.monotonic() - replica.since
                replica.set_state(S.READY, f"{replica.url}, {took:.1f}s after its start")
            elif replica.state is S.STARTING and replica.proc.returncode is None:
                log.error("engine for %s not ready after %.0fs; stopping it", replica.model,
                          self.startup_timeout_s)  # fmt: skip
                send_signal(replica.proc, signal.SIGKILL)
                timed_out = True
            code = await replica.proc.wait()
            await output
            state = replica.state
            how = exit_reason(code)
            replica.log.write(_marker(f"engine pid {pid} {how}"))
            if timed_out:
                how = f"not ready after {self.startup_timeout_s:.0f}s"
            if state is S.STOPPING:
                return  # asked to stop: the stopper finishes the transition
            if state is S.DRAINING or state is S.PARKED:
                # retiring, or asleep without requests: no point restarting it now
                replica.set_state(S.STOPPING, how)
                replica.set_state(S.STOPPED)
                return
            if state is not S.STARTING:
                exits = kills = 0  # it was ready (then crashed, or died parking or waking)
            elif code < 0 and not timed_out:
                kills += 1  # our own kill after the timeout is the start's fault, not the host's
            else:
                exits += 1
                if not served:
                    replica.set_state(S.FAILED, f"{how} before it was ever ready")
                    return
            if ready_at is not None and time.monotonic() - ready_at > STABLE_AFTER_S:
                backoff = BACKOFF_BASE_S
            replica.set_state(S.BACKOFF, f"{how}; restart in {backoff:.1f}s")
            if exits >= MAX_CRASHES or kills >= MAX_KILLED_STARTS:
                died = f"exited {exits}" if exits >= MAX_CRASHES else f"killed {kills}"
                replica.set_state(S.FAILED, f"starts {died} times before READY (last: {how})")
                return
            replica.restarts += 1
            deadline = time.monotonic() + backoff
            while replica.state is S.BACKOFF and time.monotonic() < deadline:
                await replica.wait_change(deadline - time.monotonic())
            if replica.state is not S.BACKOFF:
                return
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _start_engine(self, replica: Replica) -> EngineProcess:
        """Forked from the engine template of its wait policy when there is one, else exec'd."""
        flags = engine_command(replica.config, replica.port, ())
        forked = await self.templates.fork(flags, self.cwd, replica.spin_wait)
        if forked is not None:
            return forked
        return await spawn([*die_with_gateway(), *self.launcher, *flags], self.cwd)

    async def _watch_load(self, replica: Replica) -> None:
        """Polls the starting engine's /status for its start-up stage (replica.progress), with a
        log line per new stage, until cancelled (the pool stops it when the start ends)."""
        while replica.state is S.STARTING:
            seen = reported_progress(
                await self.client.status(replica.url, timeout_s=4 * PROGRESS_POLL_S)
            )
            if seen is not None and replica.state is S.STARTING:
                new = replica.progress is None or seen.stage != replica.progress.stage
                if new and seen.stage not in BETWEEN_PHASES:
                    took = time.monotonic() - replica.since
                    log.info("replica %s#%d loading: %s (%.1fs after its start)",
                             replica.model, replica.index, seen.stage, took)  # fmt: skip
                replica.progress = seen
            await asyncio.sleep(PROGRESS_POLL_S)

    async def _wait_ready(self, replica: Replica, state: ReplicaState) -> bool:
        """Polls /ready while the replica stays in ``state`` and its process runs."""
        assert replica.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and replica.proc.returncode is None:
            if replica.state is not state:
                return False
            if await self.client.ready(replica.url):
                return replica.state is state
            await asyncio.sleep(READY_POLL_S)
        return False

    async def _stop_replica(self, replica: Replica) -> None:
        if replica.state is S.STOPPED:
            return
        if replica.state is not S.STOPPING:
            replica.set_state(S.STOPPING)
        proc = replica.proc
        if proc is not None and proc.returncode is None:
            send_signal(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
            except TimeoutError:
                send_signal(proc, signal.SIGKILL)
                await proc.wait()
        supervisor = replica.supervisor
        if supervisor is not None and supervisor is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(supervisor), 5)
            supervisor.cancel()
        if replica.state is S.STOPPING:
            code = proc.returncode if proc is not None else None
            replica.set_state(S.STOPPED, exit_reason(code) if code is not None else "")


def _how_started(proc: EngineProcess) -> str:
    return "forked from its template" if isinstance(proc, ForkedEngine) else "exec'd"


def _marker(event: str) -> str:
    """A line of the pool's own in an engine's log file, set apart from the engine's."""
    return f"==> modelyard {time.strftime('%Y-%m-%d %H:%M:%S')}: {event} <=="
