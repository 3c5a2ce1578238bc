"""The engine pool: one engine process per replica of every local model (``source:``).

Each replica runs ``python -m engine --model SRC --served-model-name NAME --host 127.0.0.1
--port N ...`` on a free loopback port. It joins the router once its ``/ready`` answers 200; if its
process exits unexpectedly it leaves the router and is restarted after an exponential backoff.

Config changes are applied without dropping requests, one replica at a time: start a new replica,
wait for it to be ready, add it to the router, take an old one out of the router, let its in-flight
requests finish (up to ``drain_timeout_s``), then stop it. If a new replica never becomes ready the
rollout stops there and the old replicas keep serving. A GPU replica whose memory fraction does not
fit next to the running ones (a full card) is replaced the other way round: the old one drains and
stops first, so the model serves with one replica fewer meanwhile (none, if it has only one); if the
new one never becomes ready, the old one is started again and the rollout stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import aiohttp

from common.engine_args import EngineArgs
from common.net import free_port
from gateway.backend import Backend
from gateway.config import MAX_GPU_FRACTION_SUM, FleetConfig, ModelConfig

log = logging.getLogger("modelyard.pool")

READY_POLL_S = 0.25
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
STABLE_AFTER_S = 60.0  # a replica that ran this long without crashing resets its backoff


ENGINE_LAUNCHER = (sys.executable, "-m", "engine")

# Linux: engines must not outlive a gateway that dies without cleaning up (SIGKILL, OOM killer).
# A tiny exec wrapper asks the kernel to SIGKILL the child when its parent dies
# (prctl(PR_SET_PDEATHSIG), kept across exec), then becomes the engine in the same process. A
# wrapper rather than preexec_fn: that runs between fork and exec in a threaded parent, which is
# unsafe, and not every event loop supports it. The "parent" is the thread that forked: the event
# loop's, which lives as long as the gateway. The getppid() check covers a gateway that died
# before the prctl.
_PR_SET_PDEATHSIG = 1
_DIE_WITH_PARENT = f"""\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit("the gateway is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_gateway() -> list[str]:
    """The prefix that makes a command die with this process (empty where Linux's prctl is not)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())]


def engine_command(
    model: ModelConfig, port: int, launcher: tuple[str, ...] = ENGINE_LAUNCHER
) -> list[str]:
    args = EngineArgs(
        model=model.source or "",
        served_model_name=model.name,
        port=port,
        max_model_len=model.max_model_len,
        max_num_seqs=model.max_num_seqs,
        device=model.device,
        kv_cache_memory=model.kv_cache_memory,
        gpu_memory_fraction=model.gpu_memory_fraction,
        spin_wait=model.spin_wait,
        extra=model.engine_args,
    )
    return [*launcher, *args.argv()]


def spec_of(model: ModelConfig) -> tuple[str, ...]:
    """What makes two replicas interchangeable: the engine command without its port, and without
    ``--spin-wait``, which follows the fleet's size (decided per start, see ``_supervise``): a
    replica count change must not replace the other replicas."""
    return tuple(engine_command(replace(model, spin_wait=False), 0, ()))


@dataclass(eq=False)
class Replica:
    model: str
    spec: tuple[str, ...]
    config: ModelConfig
    port: int = 0
    proc: asyncio.subprocess.Process | None = None
    spin_wait: bool = False  # whether the running process got --spin-wait
    ready: bool = False
    stopping: bool = False
    restarts: int = 0
    supervisor: asyncio.Task[None] | None = None
    backend: Backend | None = None
    became_ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class EnginePool:
    """Owns the engine processes; tells the router which URLs serve each local model."""

    def __init__(
        self,
        publish: Callable[[str, list[str]], None],
        find_backend: Callable[[str, str], Backend | None],
        *,
        launcher: tuple[str, ...] = ENGINE_LAUNCHER,
        startup_timeout_s: float = 900.0,
        drain_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
        cwd: str | None = None,
    ) -> None:
        self.publish = publish  # (model, ready URLs) → router
        self.find_backend = find_backend  # (model, url) → its router Backend, for draining
        self.launcher = launcher
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.cwd = cwd
        self.replicas: dict[str, list[Replica]] = {}
        self._lock = asyncio.Lock()
        self._rollouts: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle ----

    async def apply(self, config: FleetConfig) -> None:
        """Brings the running replicas in line with ``config`` (serialised across calls)."""
        async with self._lock:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
            wanted = {m.name: m for m in config.models if m.local}
            removed = [name for name in self.replicas if name not in wanted]
            await asyncio.gather(
                *(self._retire(name, list(self.replicas[name])) for name in removed)
            )
            for name in removed:
                del self.replicas[name]
            await asyncio.gather(*(self._converge(model) for model in wanted.values()))

    def apply_soon(self, config: FleetConfig) -> None:
        """For config listeners, which cannot wait: applies in the background."""
        task = asyncio.create_task(self._apply_logged(config))
        self._rollouts.add(task)
        task.add_done_callback(self._rollouts.discard)

    async def _apply_logged(self, config: FleetConfig) -> None:
        try:
            await self.apply(config)
        except Exception:
            log.exception("applying the engine pool config failed")

    async def stop(self) -> None:
        for task in list(self._rollouts):
            task.cancel()
        async with self._lock:
            await asyncio.gather(
                *(self._stop_replica(r) for rs in self.replicas.values() for r in rs)
            )
            for name in self.replicas:
                self.publish(name, [])
            self.replicas.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- convergence ----

    async def _converge(self, model: ModelConfig) -> None:
        spec = spec_of(model)
        current = self.replicas.setdefault(model.name, [])
        stale = [r for r in current if r.spec != spec]
        for replica in current:
            if replica.spec == spec:  # stale ones keep theirs: what they run (and restart with)
                replica.config = model
        # Replace stale replicas one at a time: new one up first, then the old one out; on a GPU
        # without room for both, the old one out first.
        for old in stale:
            if self._gpu_in_use() + model.gpu_share > MAX_GPU_FRACTION_SUM:
                log.info("model %s: no GPU memory for a new replica beside the old", model.name)
                await self._retire(model.name, [old])
                if not await self._add_replica(model, spec):
                    log.error(
                        "model %s: new replica did not become ready; restarting the old one",
                        model.name,
                    )
                    await self._add_replica(old.config, old.spec)
                    return
                continue
            if not await self._add_replica(model, spec):
                log.error(
                    "model %s: new replica did not become ready; keeping the old ones", model.name
                )
                return
            await self._retire(model.name, [old])
        # Scaling down keeps first the replicas whose spin-wait suits the fleet as it will be: a
        # spinner left from a lone start is kept when the model is back to one replica (fast
        # again), and goes first otherwise.
        fresh = sorted(
            (r for r in self.replicas[model.name] if r.spec == spec),
            key=lambda r: r.spin_wait != model.spin_wait,
        )
        for _ in range(model.replicas - len(fresh)):
            if not await self._add_replica(model, spec):
                log.error("model %s: replica did not become ready", model.name)
                return
        surplus = fresh[model.replicas :]
        if surplus:
            await self._retire(model.name, surplus)

    def _gpu_in_use(self) -> float:
        """The GPU memory fraction of every replica started and not yet stopped."""
        return sum(r.config.gpu_share for rs in self.replicas.values() for r in rs)

    async def _add_replica(self, model: ModelConfig, spec: tuple[str, ...]) -> bool:
        replica = Replica(model=model.name, spec=spec, config=model)
        self.replicas[model.name].append(replica)
        replica.supervisor = asyncio.create_task(self._supervise(replica))
        ready = asyncio.ensure_future(replica.became_ready.wait())
        failed = asyncio.ensure_future(replica.failed.wait())
        try:
            await asyncio.wait((ready, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            failed.cancel()
        if replica.became_ready.is_set():
            return True
        await self._retire(model.name, [replica])
        return False

    async def _retire(self, model: str, replicas: list[Replica]) -> None:
        """Out of the router first, then drain, then stop."""
        backends = [r.backend for r in replicas if r.ready]
        for replica in replicas:
            replica.stopping = True
        self._publish(model, exclude=replicas)
        deadline = time.monotonic() + self.drain_timeout_s
        for backend in backends:
            while backend is not None and backend.outstanding > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await asyncio.gather(*(self._stop_replica(r) for r in replicas))
        remaining = [r for r in self.replicas.get(model, []) if r not in replicas]
        if model in self.replicas:
            self.replicas[model] = remaining

    def _publish(self, model: str, exclude: Collection[Replica] = ()) -> None:
        urls = [
            r.url
            for r in self.replicas.get(model, [])
            if r.ready and not r.stopping and r not in exclude
        ]
        self.publish(model, urls)

    # ---- one replica ----

    async def _supervise(self, replica: Replica) -> None:
        """Start, wait for /ready, watch; restart with backoff after an unexpected exit."""
        backoff = BACKOFF_BASE_S
        while not replica.stopping:
            replica.port = free_port()
            # Spin-wait is decided here, at every start, from the fleet as configured now
            # (replica.config follows reloads); a running engine keeps what it started with.
            replica.spin_wait = replica.config.spin_wait
            command = die_with_gateway() + engine_command(
                replica.config, replica.port, self.launcher
            )
            log.info("starting engine for %s on port %d", replica.model, replica.port)
            try:
                replica.proc = await asyncio.create_subprocess_exec(
                    # stdout to our stderr (fd 2): the gateway's stdout is its access log.
                    *command,
                    cwd=self.cwd,
                    stdout=2,
                    stderr=None,
                    start_new_session=True,
                )  # our SIGINT is not theirs: we stop them in order
            except OSError as exc:
                log.error("cannot start engine for %s: %s", replica.model, exc)
                replica.failed.set()
                return
            started = time.monotonic()
            if await self._wait_ready(replica):
                replica.ready = True
                replica.became_ready.set()
                self._publish(replica.model)
                # Kept so that draining can count its in-flight requests even after the
                # router dropped it (say, because its model left the config).
                replica.backend = self.find_backend(replica.model, replica.url)
                log.info("engine for %s ready at %s", replica.model, replica.url)
            code = await replica.proc.wait()
            was_ready, replica.ready = replica.ready, False
            if replica.stopping:
                return
            self._publish(replica.model)
            if not was_ready and not replica.became_ready.is_set():
                log.error("engine for %s exited with %s before it was ready", replica.model, code)
                replica.failed.set()  # a first start that fails is a config problem: no loop
                return
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = BACKOFF_BASE_S
            replica.restarts += 1
            log.error(
                "engine for %s exited with %s; restarting in %.1fs (restart #%d)",
                replica.model,
                code,
                backoff,
                replica.restarts,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _wait_ready(self, replica: Replica) -> bool:
        assert replica.proc is not None and self._session is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and replica.proc.returncode is None:
            if replica.stopping:
                return False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with self._session.get(replica.url + "/ready") as resp:
                    if resp.status == 200:
                        return True
            await asyncio.sleep(READY_POLL_S)
        if replica.proc.returncode is None:
            log.error(
                "engine for %s not ready after %.0fs; stopping it",
                replica.model,
                self.startup_timeout_s,
            )
            self._signal(replica, signal.SIGKILL)
        return False

    async def _stop_replica(self, replica: Replica) -> None:
        replica.stopping = True
        replica.ready = False
        proc = replica.proc
        if proc is not None and proc.returncode is None:
            self._signal(replica, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
            except TimeoutError:
                self._signal(replica, signal.SIGKILL)
                await proc.wait()
        if replica.supervisor is not None and replica.supervisor is not asyncio.current_task():
            replica.supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.supervisor

    @staticmethod
    def _signal(replica: Replica, sig: int) -> None:
        if replica.proc is not None and replica.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica.proc.pid, sig)
