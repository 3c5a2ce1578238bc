"""The engine pool with a fake engine process: spawn, readiness, crash restart, rolling reload."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from gateway.app import Gateway
from gateway.config import load_config
from gateway.engines.process import engine_command
from gateway.engines.replica import ReplicaState
from tests.gateway.test_resilience import wait_for


def local_fleet(tmp_path: Path, replicas: int = 2, **model) -> dict:
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"GGUF")
    return {
        "gateway": {
            "health": {"interval_s": 0.2, "timeout_s": 0.5},
            "ejection": {"consecutive_failures": 2, "base_s": 0.3},
            "retries": {"attempts": 3, "backoff_ms": 5},
            "watch_config": False,
        },
        "models": [
            {
                "name": "local",
                "aliases": ["default"],
                "source": str(source),
                "replicas": replicas,
                "kv_cache_memory": "64MiB",
                "max_num_seqs": 4,
                **model,
            }
        ],
    }


def pids(gateway: Gateway) -> set[int]:
    return {r.proc.pid for r in gateway.pool.replicas.get("local", []) if r.proc}


def alive(pid: int) -> bool:
    """Running: a zombie (exited, not yet reaped) counts as gone, and so does a process reaped while
    we look (a kill(pid, 0) then a /proc read raced the reap, which raised)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    return state not in ("Z", "X")


async def chat(session, url: str, model: str = "default") -> int:
    async with session.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
    ) as resp:
        await resp.read()
        return resp.status


def test_engine_command_flags(tmp_path):
    doc = local_fleet(tmp_path, gpu_memory_fraction=0.3, engine_args=["--num-threads", "2"])
    config = load_config(_write(tmp_path, doc))
    cmd = engine_command(config.models[0], 9123)
    assert cmd[1:3] == ["-m", "engine"]
    joined = " ".join(cmd)
    for flag in (
        "--served-model-name local",
        "--host 127.0.0.1",
        "--port 9123",
        "--max-num-seqs 4",
        f"--kv-cache-memory {64 * 2**20}",
        "--gpu-memory-fraction 0.3",
        "--device auto",
        "--num-threads 2",
    ):
        assert flag in joined


def test_only_the_fleets_single_engine_spins(tmp_path):
    """--spin-wait (engine.model.cpu.openmp_env) goes to a fleet's only local engine, never to
    engines that share the machine with others; upstream-only models do not count."""

    def flags(doc: dict) -> list[bool]:
        config = load_config(_write(tmp_path, doc))
        return ["--spin-wait" in engine_command(m, 9123) for m in config.models if m.local]

    single = local_fleet(tmp_path, replicas=1)
    single["models"].append({"name": "far", "upstreams": ["http://127.0.0.1:9"]})
    assert flags(single) == [True]
    assert flags(local_fleet(tmp_path, replicas=2)) == [False]
    two = local_fleet(tmp_path, replicas=1)
    two["models"].append({**two["models"][0], "name": "second", "aliases": []})
    assert flags(two) == [False, False]


@pytest.mark.parametrize(
    ("counts", "spinning"),
    [((2, 1, 2), [False, False]), ((1, 2, 1), [True]), ((1, 3, 2), [False, False])],
)
async def test_scaling_replicas_leaves_the_other_replicas_running(
    pooled, tmp_path, monkeypatch, counts, spinning
):
    """A replica count change starts or stops only the replicas it adds or removes, although it
    changes whether the fleet has a lone engine: --spin-wait is decided per engine start and is
    not part of what makes a replica stale. Scaling down keeps first the replicas whose spin-wait
    suits the new count: back to one, the lone spinner stays; to several, it goes first."""
    commands: list[list[str]] = []
    engines: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def counting_spawn(*command, **kwargs):
        commands.append(list(command))
        engines.append(await spawn(*command, **kwargs))
        return engines[-1]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", counting_spawn)
    gateway, _, path = await pooled(local_fleet(tmp_path, replicas=counts[0]))
    await gateway.pool.apply(gateway.config)  # waits for the start-up
    for replicas in counts[1:]:
        path.write_text(yaml.safe_dump(local_fleet(tmp_path, replicas=replicas)))
        await gateway.reload()
        await gateway.pool.apply(gateway.config)  # waits for the scaling
    steps = list(itertools.pairwise(counts))
    added = counts[0] + sum(max(0, new - old) for old, new in steps)
    removed = sum(max(0, old - new) for old, new in steps)
    assert len(engines) == added  # e.g. 2→1→2: two at start-up, then one
    assert [e.returncode is not None for e in engines].count(True) == removed
    assert all(r.restarts == 0 for r in gateway.pool.replicas["local"])
    assert {r.proc for r in gateway.pool.replicas["local"]} == {
        e for e in engines if e.returncode is None
    }
    # Only an engine started as the fleet's only one spins.
    assert ["--spin-wait" in c for c in commands] == [counts[0] == 1] + [False] * (added - 1)
    assert [r.spin_wait for r in gateway.pool.replicas["local"]] == spinning
    route = gateway.router.resolve("local")
    await wait_for(lambda: len(route.backends) == counts[-1], timeout=5)


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_spawn_route_restart_and_stop(pooled, tmp_path):
    import aiohttp

    gateway, url, _ = await pooled(
        local_fleet(tmp_path, replicas=2, engine_args=["--ready-delay-s", "0.3"])
    )
    route = gateway.router.resolve("local")
    async with aiohttp.ClientSession() as session:
        # still loading: the request is held until a replica is ready, not refused
        assert await chat(session, url) == 200
        assert gateway.metrics.admission_wait.labels("local", "_anonymous")._sum.get() > 0
        await wait_for(lambda: len(route.backends) == 2, timeout=15)
        assert await chat(session, url) == 200
        ready = await (await session.get(url + "/ready")).json()
        assert ready["models"] == {"local": True}
        # SIGKILL one engine while traffic flows: requests keep succeeding, it comes back.
        victim = gateway.pool.replicas["local"][0]
        old_pid = victim.proc.pid
        statuses = []

        async def traffic():
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                statuses.append(await chat(session, url))

        task = asyncio.create_task(traffic())
        await asyncio.sleep(0.2)
        os.kill(old_pid, signal.SIGKILL)
        await wait_for(
            lambda: victim.proc.pid != old_pid and victim.state is ReplicaState.READY, timeout=10
        )
        await task
        assert statuses and set(statuses) == {200}
        assert victim.restarts == 1
        assert len(route.backends) == 2
    engine_pids = pids(gateway)
    await gateway.pool.stop()
    assert not any(alive(pid) for pid in engine_pids)
    assert route.backends == []


async def test_rolling_reload_without_dropping_requests(pooled, tmp_path):
    import aiohttp

    gateway, url, path = await pooled(local_fleet(tmp_path, replicas=2))
    route = gateway.router.resolve("local")
    await wait_for(lambda: len(route.backends) == 2, timeout=15)
    before = pids(gateway)
    statuses = []
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()

        async def traffic():
            while not stop.is_set():
                statuses.append(await chat(session, url))

        tasks = [asyncio.create_task(traffic()) for _ in range(4)]
        # A changed engine setting: every replica is replaced, one at a time.
        path.write_text(yaml.safe_dump(local_fleet(tmp_path, replicas=2, max_num_seqs=8)))
        await gateway.reload()
        await wait_for(
            lambda: (
                not (pids(gateway) & before)
                and len(route.backends) == 2
                and all(r.state is ReplicaState.READY for r in gateway.pool.replicas["local"])
            ),
            timeout=20,
        )
        stop.set()
        await asyncio.gather(*tasks)
        assert len(statuses) > 20 and set(statuses) == {200}
        assert not any(alive(pid) for pid in before)
        assert all("--max-num-seqs 8" in " ".join(r.spec) for r in gateway.pool.replicas["local"])
        # A new engine that cannot start: the rollout stops and the old replicas keep serving.
        serving = pids(gateway)
        path.write_text(
            yaml.safe_dump(local_fleet(tmp_path, replicas=2, engine_args=["--fail-start"]))
        )
        await gateway.reload()
        await gateway.pool.apply(gateway.config)  # waits for the (failing) rollout
        assert pids(gateway) == serving
        assert await chat(session, url) == 200
        # Scale down, then remove the model: its engines stop.
        path.write_text(yaml.safe_dump(local_fleet(tmp_path, replicas=1, max_num_seqs=8)))
        await gateway.reload()
        await gateway.pool.apply(gateway.config)
        assert len(route.backends) == 1 and len(pids(gateway)) == 1
        remaining = pids(gateway)
        doc = local_fleet(tmp_path)
        doc["models"] = [{"name": "other", "upstreams": ["http://127.0.0.1:9"]}]
        path.write_text(yaml.safe_dump(doc))
        await gateway.reload()
        await gateway.pool.apply(gateway.config)
        assert not any(alive(pid) for pid in remaining)
        assert await chat(session, url) == 404


@pytest.mark.parametrize(("fraction", "most_alive"), [(0.3, 3), (0.45, 2)])
async def test_gpu_rollout_surges_only_when_the_card_has_room(
    pooled, tmp_path, fraction, most_alive
):
    """2 GPU replicas of `fraction`: with room for a third (0.9 <= 0.95) a changed setting starts
    each new replica beside the old one; on a full card (0.45: 1.35 > 0.95) each old one drains and
    stops first, so there are never more engines than the card holds. Requests keep succeeding."""
    import aiohttp

    fleet = local_fleet(tmp_path, replicas=2, device="cuda", gpu_memory_fraction=fraction)
    gateway, url, path = await pooled(fleet)
    route = gateway.router.resolve("local")
    await wait_for(lambda: len(route.backends) == 2, timeout=15)
    before = pids(gateway)
    alive_counts, statuses = [], []
    stop = asyncio.Event()

    async def watch():
        while not stop.is_set():
            alive_counts.append(sum(alive(pid) for pid in pids(gateway)))
            await asyncio.sleep(0.01)

    async with aiohttp.ClientSession() as session:

        async def traffic():
            while not stop.is_set():
                statuses.append(await chat(session, url))

        tasks = [asyncio.create_task(watch()), asyncio.create_task(traffic())]
        changed = local_fleet(
            tmp_path, replicas=2, device="cuda", gpu_memory_fraction=fraction, max_num_seqs=8
        )
        path.write_text(yaml.safe_dump(changed))
        await gateway.reload()
        await gateway.pool.apply(gateway.config)  # waits for the rollout
        stop.set()
        await asyncio.gather(*tasks)
    assert not (pids(gateway) & before) and len(route.backends) == 2
    assert max(alive_counts) == most_alive
    assert len(statuses) > 5 and set(statuses) == {200}


async def test_full_card_rollout_that_fails_restarts_the_old_replica(pooled, tmp_path):
    """On a full card the old replica stops before the new one starts; a new engine that cannot
    start gives the model its old replica back, and the rollout stops there."""
    import aiohttp

    fleet = local_fleet(tmp_path, replicas=2, device="cuda", gpu_memory_fraction=0.45)
    gateway, url, path = await pooled(fleet)
    route = gateway.router.resolve("local")
    await wait_for(lambda: len(route.backends) == 2, timeout=15)
    old_specs = {r.spec for r in gateway.pool.replicas["local"]}
    broken = local_fleet(
        tmp_path, replicas=2, device="cuda", gpu_memory_fraction=0.45, engine_args=["--fail-start"]
    )
    path.write_text(yaml.safe_dump(broken))
    await gateway.reload()
    await gateway.pool.apply(gateway.config)  # waits for the (failing) rollout
    await wait_for(lambda: len(route.backends) == 2, timeout=15)
    assert {r.spec for r in gateway.pool.replicas["local"]} == old_specs
    assert sum(alive(pid) for pid in pids(gateway)) == 2
    async with aiohttp.ClientSession() as session:
        assert await chat(session, url) == 200
