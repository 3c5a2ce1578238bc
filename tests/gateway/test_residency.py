"""Residency with fake engine processes: on-demand loading, park after the idle TTL and wake,
budgeted eviction by least recent use (never a busy model), requests held while a model loads
(bounded in count and time, left at once by a client that disconnects), a crashing replica's
requests held until it is back, and a model that cannot start ending FAILED with its log (crashes
while serving never fail it). Under admin storms: a request that meets its replica asleep is held
while it wakes, a park after a wake waits for the requests in flight, and an unload that
interrupts a load answers its held requests model_unloaded, not model_failed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.engines import pool as pool_module
from gateway.engines.replica import ReplicaState
from gateway.residency import manager as manager_module
from tests.gateway.test_resilience import wait_for

S = ReplicaState
MiB = 2**20
ANON = "_anonymous"  # open mode's one tenant


def fleet(tmp_path: Path, models: list[dict], memory: dict | None = None) -> dict:
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"GGUF")
    gateway = {
        "health": {"interval_s": 0.2, "timeout_s": 0.5},
        "retries": {"attempts": 3, "backoff_ms": 5},
        "watch_config": False,
    }
    if memory:
        gateway["memory"] = memory
    base = {"source": str(source), "kv_cache_memory": "64MiB", "max_num_seqs": 4}
    return {"gateway": gateway, "models": [{**base, **m} for m in models]}


def on_demand(name: str, *engine_args: str, **keys) -> dict:
    args = ["--rss-bytes", str(1024 * MiB), "--parked-rss-bytes", str(256 * MiB), *engine_args]
    # the estimate before the first measurement is what the engine will report
    keys = {"memory_estimate": "1GiB", **keys}
    return {"name": name, "residency": "on_demand", "engine_args": args, **keys}


def states(gateway, name: str) -> list[ReplicaState]:
    return gateway.pool.states(name)


def sample(gateway, metric: str, **labels) -> float:
    return gateway.metrics.registry.get_sample_value(metric, labels) or 0.0


async def request(session, url: str, model: str, **mock) -> tuple[int, dict, float]:
    started = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "mock": mock}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        return resp.status, {"body": payload, "headers": resp.headers}, time.monotonic() - started


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(manager_module, "PLAN_RETRY_S", 0.05)


async def test_on_demand_starts_at_first_request_parks_after_ttl_and_wakes(pooled, tmp_path):
    # device auto with a GPU fraction: on this CPU engine the fraction must not count
    model = on_demand("od", "--ready-delay-s", "0.3", idle_ttl_s=0.6, gpu_memory_fraction=0.5)
    doc = fleet(tmp_path, [model])
    gateway, url, _ = await pooled(doc)
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(0.3)
        assert states(gateway, "od") == []  # nothing started before a request
        # Its load time is exported at zero already (None: no such series), so that a
        # dashboard's rate() sees the first load.
        cold = {"model": "od", "kind": "cold"}
        registry = gateway.metrics.registry
        assert registry.get_sample_value("modelyard_model_load_seconds_count", cold) == 0
        models = await (await session.get(url + "/v1/models")).json()
        assert [(m["id"], m["state"]) for m in models["data"]] == [("od", "stopped")]
        status, _, took = await request(session, url, "od")
        assert status == 200 and took >= 0.3  # held while it loaded
        assert states(gateway, "od") == [S.READY]
        pid = gateway.pool.replicas["od"][0].proc.pid
        assert sample(gateway, "modelyard_model_load_seconds_count", model="od", kind="cold") == 1
        await wait_for(lambda: states(gateway, "od") == [S.PARKED], timeout=5)
        assert sample(gateway, "modelyard_model_evictions_total", model="od", action="park",
                      reason="idle") == 1  # fmt: skip
        models = await (await session.get(url + "/v1/models")).json()
        assert models["data"][0]["state"] == "parked"
        status, _, _ = await request(session, url, "od")
        assert status == 200 and states(gateway, "od") == [S.READY]
        assert gateway.pool.replicas["od"][0].proc.pid == pid  # woken, not restarted
        assert sample(gateway, "modelyard_model_load_seconds_count", model="od", kind="wake") == 1
        # the footprint the fake engine reported replaced the estimate
        footprint = gateway.residency.describe("od")["footprint"]
        assert footprint == {"awake_bytes": 1024 * MiB, "parked_bytes": 256 * MiB,
                             "growth_bytes": 0, "gpu_fraction": 0.0,
                             "source": "measured"}  # fmt: skip


async def test_budget_for_two_evicts_the_least_recent_idle_model_never_a_busy_one(pooled, tmp_path):
    # 1 GiB awake, 256 MiB parked each: two awake fit in 2.5 GiB, three do not.
    models = [on_demand(name, idle_ttl_s=600) for name in ("a", "b", "c")]
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "2560MiB"}))
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "a"))[0] == 200
        assert (await request(session, url, "b"))[0] == 200
        await wait_for(lambda: gateway.residency.models["b"].footprint.measured, timeout=5)
        # "a" is the least recently used but busy: its request is in flight for 1.5 s.
        busy = asyncio.create_task(request(session, url, "a", delay_ms=1500))
        await wait_for(lambda: gateway.router.resolve("a").inflight == 1, timeout=5)
        await asyncio.sleep(0.05)
        assert (await request(session, url, "b"))[0] == 200  # "b" used after "a" started
        status, _, _ = await request(session, url, "c")
        assert status == 200
        assert states(gateway, "a") == [S.READY] and states(gateway, "b") == [S.PARKED]
        assert (await busy)[0] == 200  # "a" is now the most recent (its request ended last)
        budget = gateway.residency.budget()
        assert budget["cpu_resident_bytes"] == 2 * 1024 * MiB + 256 * MiB <= budget["cpu_bytes"]
        # "b" is wanted again: "c", idle and now the least recent, makes room; "b" wakes
        assert (await request(session, url, "b"))[0] == 200
        assert states(gateway, "c") == [S.PARKED] and states(gateway, "b") == [S.READY]
        assert states(gateway, "a") == [S.READY]
        assert sample(gateway, "modelyard_model_evictions_total", model="c", action="park",
                      reason="memory") == 1  # fmt: skip


async def test_parked_models_are_stopped_when_parking_is_not_enough(pooled, tmp_path):
    models = [on_demand(name, idle_ttl_s=600) for name in ("a", "b")]
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "1200MiB"}))
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "a"))[0] == 200
        await wait_for(lambda: gateway.residency.models["a"].footprint.measured, timeout=5)
        assert (await request(session, url, "b"))[0] == 200  # 1 GiB + 256 MiB > 1200 MiB
        assert states(gateway, "a") == [] and states(gateway, "b") == [S.READY]
        assert sample(gateway, "modelyard_model_evictions_total", model="a", action="stop",
                      reason="memory") == 1  # fmt: skip


async def test_held_requests_are_bounded_in_count_and_time(pooled, tmp_path):
    slow = on_demand("slow", "--ready-delay-s", "2.5", queue={"max_requests": 2, "max_wait_s": 1})
    gateway, url, _ = await pooled(fleet(tmp_path, [slow]))
    async with aiohttp.ClientSession() as session:
        held = [asyncio.create_task(request(session, url, "slow")) for _ in range(2)]
        await wait_for(lambda: gateway.admission.waiting("slow") == 2, timeout=5)
        status, answer, took = await request(session, url, "slow")
        assert status == 503 and took < 0.5
        assert answer["body"]["error"]["code"] == "hold_queue_full"
        assert answer["headers"]["Retry-After"] == "5"
        for status, answer, took in await asyncio.gather(*held):
            assert status == 503 and 0.9 < took < 2.0
            assert answer["body"]["error"]["code"] == "model_loading_timeout"
            assert set(answer["body"]["error"]) == {"message", "type", "param", "code"}
            assert answer["headers"]["Retry-After"] == "5"
        assert sample(gateway, "modelyard_admission_refused_total", model="slow",
                      reason="hold_queue_full") == 1  # fmt: skip
        assert sample(gateway, "modelyard_admission_refused_total", model="slow",
                      reason="model_loading_timeout") == 2  # fmt: skip
        await wait_for(lambda: states(gateway, "slow") == [S.READY], timeout=10)
        assert (await request(session, url, "slow"))[0] == 200


async def test_a_disconnecting_held_client_leaves_no_trace(pooled, tmp_path):
    doc = fleet(tmp_path, [on_demand("od", "--ready-delay-s", "1.5")])
    gateway, url, _ = await pooled(doc)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4)) as impatient:
        with pytest.raises(TimeoutError):
            await request(impatient, url, "od")
    await wait_for(lambda: gateway.admission.waiting("od") == 0, timeout=2)
    assert sample(gateway, "modelyard_admission_queue_depth", model="od", band="0") == 0
    await wait_for(lambda: states(gateway, "od") == [S.READY], timeout=10)
    upstream = gateway.pool.replicas["od"][0].url
    async with aiohttp.ClientSession() as session:
        stats = await (await session.get(upstream + "/stats")).json()
        assert stats["requests"] == 0  # the gone client's request was never sent
        assert (await request(session, url, "od"))[0] == 200


async def test_kill_9_of_the_only_replica_under_load_holds_requests_until_it_is_back(
    pooled, tmp_path
):
    doc = fleet(tmp_path, [{"name": "m", "engine_args": ["--ready-delay-s", "0.5"]}])
    gateway, url, _ = await pooled(doc)
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=10)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 3.0

        async def traffic():
            while time.monotonic() < deadline:
                statuses.append((await request(session, url, "m", delay_ms=20))[0])

        tasks = [asyncio.create_task(traffic()) for _ in range(3)]
        await asyncio.sleep(0.3)
        replica = gateway.pool.replicas["m"][0]
        old = replica.proc.pid
        os.kill(old, signal.SIGKILL)
        await asyncio.gather(*tasks)
    assert replica.proc.pid != old and replica.restarts == 1
    assert len(statuses) > 10 and set(statuses) == {200}
    # requests waited in the line while it restarted (a backoff and a 0.5 s start)
    assert sample(gateway, "modelyard_admission_wait_seconds_sum", model="m", key=ANON) > 0.3


async def test_a_model_that_cannot_start_is_failed_with_its_log(pooled, tmp_path):
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("bad", "--fail-start")]))
    async with aiohttp.ClientSession() as session:
        status, answer, _ = await request(session, url, "bad")
        assert status == 503 and answer["body"]["error"]["code"] == "model_failed"
        assert states(gateway, "bad") == [S.FAILED]
        spawned = gateway.pool.replicas["bad"][0]
        status, _, took = await request(session, url, "bad")  # no new start: at once
        assert status == 503 and took < 0.3 and gateway.pool.replicas["bad"] == [spawned]
        listing = await (await session.get(url + "/admin/models")).json()
        (bad,) = listing["models"]
        assert bad["state"] == "failed"
        assert "fake engine: cannot load the model" in bad["replicas"][0]["last_log_lines"]
        # an operator's load tries again (and fails again, with the same answer)
        async with session.post(url + "/admin/models/bad/load") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "model_failed"
        assert gateway.pool.replicas["bad"] != [spawned]


async def test_crashes_while_serving_restart_it_with_backoff_but_never_fail_it(
    pooled, tmp_path, monkeypatch
):
    """A request may be what crashes an engine: crashes after READY, however many, only restart
    it (with backoff), never fail the model for everyone."""
    monkeypatch.setattr(pool_module, "MAX_CRASHES", 2)
    monkeypatch.setattr(pool_module, "BACKOFF_BASE_S", 0.05)
    doc = fleet(tmp_path, [{"name": "m", "engine_args": ["--crash-after-ready-s", "0.2"]}])
    gateway, _, _ = await pooled(doc)
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    replica = gateway.pool.replicas["m"][0]

    def serving_after_many_crashes() -> bool:
        assert replica.state is not S.FAILED, replica.log.tail(20)
        return replica.restarts > 2 and replica.state is S.READY

    await wait_for(serving_after_many_crashes, timeout=30)


async def test_restarts_that_never_get_ready_end_failed(pooled, tmp_path, monkeypatch):
    monkeypatch.setattr(pool_module, "MAX_CRASHES", 2)
    monkeypatch.setattr(pool_module, "BACKOFF_BASE_S", 0.05)
    marker = tmp_path / "started"
    doc = fleet(tmp_path, [{"name": "m", "engine_args": ["--first-start-only", str(marker)]}])
    gateway, url, _ = await pooled(doc)
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    replica = gateway.pool.replicas["m"][0]
    os.kill(replica.proc.pid, signal.SIGKILL)  # a crash while serving: restarted, but...
    await wait_for(lambda: states(gateway, "m") == [S.FAILED], timeout=15)
    assert replica.restarts == 2  # ...every restart dies before READY: 2 in a row
    async with aiohttp.ClientSession() as session:
        status, answer, _ = await request(session, url, "m")
        assert status == 503 and answer["body"]["error"]["code"] == "model_failed"


async def test_operator_load_park_unload(pooled, tmp_path):
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", idle_ttl_s=600)]))
    async with aiohttp.ClientSession() as session:

        async def act(action: str) -> dict:
            async with session.post(url + f"/admin/models/od/{action}") as resp:
                assert resp.status == 200
                return await resp.json()

        assert (await act("load"))["state"] == "ready"
        assert (await act("park"))["state"] == "parked"
        assert (await act("load"))["state"] == "ready"
        assert (await act("unload"))["state"] == "stopped"
        async with session.post(url + "/admin/models/nope/load") as resp:
            assert resp.status == 404
        listing = await (await session.get(url + "/admin/models")).json()
        assert listing["memory"]["cpu_resident_bytes"] == 0
        assert sample(gateway, "modelyard_model_evictions_total", model="od", action="park",
                      reason="operator") == 1  # fmt: skip


async def test_a_held_stream_gets_its_headers_when_the_engine_answers(pooled, tmp_path):
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", "--ready-delay-s", "0.8")]))
    body = {"model": "od", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            headers_after = time.monotonic() - started
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
    assert headers_after >= 0.8  # not a 200 sent early and an error event later
    assert text.rstrip().endswith("data: [DONE]")
    assert sample(gateway, "modelyard_admission_wait_seconds_count", model="od", key=ANON) == 1
    assert sample(gateway, "modelyard_admission_wait_seconds_sum", model="od", key=ANON) >= 0.8


def within_budget(gateway) -> bool:
    budget = gateway.residency.budget()
    return budget["cpu_resident_bytes"] <= budget["cpu_bytes"]


async def test_concurrent_loads_do_not_both_count_the_same_free_memory(pooled, tmp_path):
    models = [on_demand(name, "--ready-delay-s", "0.3", idle_ttl_s=600) for name in "abc"]
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "2560MiB"}))
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "a"))[0] == 200
        seen_within: list[bool] = []

        async def watch():
            while True:
                seen_within.append(within_budget(gateway))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        both = await asyncio.gather(request(session, url, "b"), request(session, url, "c"))
        watcher.cancel()
        assert [status for status, _, _ in both] == [200, 200]
        assert states(gateway, "a") == [S.PARKED]  # one of the two made room, once
        assert seen_within and all(seen_within)


async def test_a_wake_counts_the_whole_awake_footprint(pooled, tmp_path):
    # 2900 MiB: a parked + b + c awake = 2304; waking a adds 1024, not 768 (it leaves its floor)
    models = [on_demand(name, idle_ttl_s=600) for name in "abc"]
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "2900MiB"}))
    async with aiohttp.ClientSession() as session:
        for name in "abc":
            assert (await request(session, url, name))[0] == 200
        assert states(gateway, "a") == [S.PARKED] and within_budget(gateway)
        assert (await request(session, url, "a"))[0] == 200
        assert states(gateway, "b") == [S.PARKED] and states(gateway, "a") == [S.READY]
        assert within_budget(gateway)


async def admin(session, url: str, action: str, model: str = "od") -> int:
    async with session.post(url + f"/admin/models/{model}/{action}") as resp:
        return resp.status


async def test_a_request_that_meets_its_replica_asleep_is_held_while_it_wakes(pooled, tmp_path):
    """Routed to a ready replica that was then parked (the park's drain gave up waiting), the
    request meets the engine's 503 engine_sleeping: it is held and the model woken, without a
    retry (there is none to spend here)."""
    doc = fleet(tmp_path, [on_demand("od", idle_ttl_s=600)])
    doc["gateway"]["retries"] = {"attempts": 1}
    gateway, url, _ = await pooled(doc)
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "od"))[0] == 200
        gateway.pool.drain_timeout_s = 0.05
        backend = gateway.router.resolve("od").backends[0]
        late = asyncio.create_task(request(session, url, "od", arrive_delay_ms=800))
        await wait_for(lambda: backend.outstanding == 1, timeout=5)
        assert await admin(session, url, "park") == 200
        engine = gateway.pool.replicas["od"][0].url
        status, answer, _ = await late
        assert status == 200, answer["body"]
        assert states(gateway, "od") == [S.READY]
        stats = await (await session.get(engine + "/stats")).json()
        assert stats["asleep_answers"] == 1  # it did meet the sleeping engine
    assert sample(gateway, "modelyard_model_load_seconds_count", model="od", kind="wake") == 1


async def test_a_park_after_a_wake_waits_for_the_requests_in_flight(pooled, tmp_path):
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", idle_ttl_s=600)]))
    async with aiohttp.ClientSession() as session:
        for action in ("load", "park", "load"):  # woken: its URL is a new backend in the router
            assert await admin(session, url, action) == 200
        backend = gateway.router.resolve("od").backends[0]
        late = asyncio.create_task(request(session, url, "od", arrive_delay_ms=500))
        await wait_for(lambda: backend.outstanding == 1, timeout=5)
        assert await admin(session, url, "park") == 200
        assert (await late)[0] == 200 and states(gateway, "od") == [S.PARKED]
        engine = gateway.pool.replicas["od"][0].url
        stats = await (await session.get(engine + "/stats")).json()
        assert stats["asleep_answers"] == 0  # the park waited for it


@pytest.mark.parametrize("request_meanwhile", [False, True])
async def test_an_unload_that_interrupts_a_load_is_no_failure(pooled, tmp_path, request_meanwhile):
    """An unload queued behind another one while a request's load waits for both: the held request
    is told the model was unloaded (not that it failed), and the model ends stopped; a request
    that comes during the unloads (or after them) loads it again."""
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", idle_ttl_s=600)]))
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "od"))[0] == 200
        busy = asyncio.create_task(request(session, url, "od", delay_ms=1500))
        await wait_for(lambda: gateway.router.resolve("od").inflight == 1, timeout=5)
        first_unload = asyncio.create_task(admin(session, url, "unload"))  # drains `busy`
        await wait_for(lambda: states(gateway, "od") == [S.DRAINING], timeout=5)
        held = asyncio.create_task(request(session, url, "od"))
        await wait_for(lambda: "od" in gateway.pool.active, timeout=5)  # its load has begun
        second_unload = asyncio.create_task(admin(session, url, "unload"))
        status, answer, _ = await held
        assert status == 503 and answer["body"]["error"]["code"] == "model_unloaded"
        assert answer["headers"]["Retry-After"] == "5"
        meanwhile = asyncio.create_task(request(session, url, "od")) if request_meanwhile else None
        assert await first_unload == 200 and await second_unload == 200
        assert (await busy)[0] == 200
        if meanwhile is None:
            assert gateway.residency.model_state("od") == "stopped"
            meanwhile = asyncio.create_task(request(session, url, "od"))
        assert (await meanwhile)[0] == 200
        assert states(gateway, "od") == [S.READY]
    refused = {
        reason: sample(gateway, "modelyard_admission_refused_total", model="od", reason=reason)
        for reason in ("model_unloaded", "model_failed")
    }
    assert refused == {"model_unloaded": 1, "model_failed": 0}


async def test_structured_growth_is_reserved_once_and_what_grew_makes_room(
    pooled, tmp_path, monkeypatch
):
    monkeypatch.setattr(manager_module, "MEASURE_EVERY_S", 0.2)
    # 1 GiB awake, 512 MiB more if it compiles grammars, 256 MiB parked: two awake fit in
    # 2.5 GiB with the growth reserved once (with it reserved for each, 3 GiB, they would not)
    grows = ("--structured-headroom-bytes", str(512 * MiB), "--compiled-rss-bytes", str(1536 * MiB))
    models = [on_demand(name, *grows, idle_ttl_s=600) for name in ("a", "b")]
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "2560MiB"}))
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "a"))[0] == 200
        await wait_for(lambda: gateway.residency.models["a"].footprint.measured, timeout=5)
        assert gateway.residency.models["a"].footprint.growth_bytes == 512 * MiB
        assert (await request(session, url, "b"))[0] == 200
        assert states(gateway, "a") == [S.READY] and states(gateway, "b") == [S.READY]
        # "a" compiles: 1.5 GiB now, its growth spent; with "b"'s growth still reserved that is
        # 1.5 + 1 + 0.5 > 2.5: the next measurement parks idle "b" (the least recently used)
        assert (await request(session, url, "a", compile=True))[0] == 200
        await wait_for(lambda: states(gateway, "b") == [S.PARKED], timeout=5)
        assert states(gateway, "a") == [S.READY]
        assert sample(gateway, "modelyard_model_evictions_total", model="b", action="park",
                      reason="memory") == 1  # fmt: skip
        resident = 1536 * MiB + 256 * MiB  # once "b"'s parked floor is measured
        await wait_for(
            lambda: gateway.residency.budget()["cpu_resident_bytes"] == resident, timeout=5
        )


async def small_copies_with_two_awake(pooled, tmp_path, *engine_args: str):
    """Copies "a", "b", "c" of a small model (300 MiB awake, 100 MiB parked, estimated at 600 MiB)
    in a 1000 MiB budget, "a" then "b" loaded and measured: the gateway and its URL."""
    small = ["--rss-bytes", str(300 * MiB), "--parked-rss-bytes", str(100 * MiB), *engine_args]
    models = [
        {"name": name, "residency": "on_demand", "engine_args": small, "idle_ttl_s": 600,
         "memory_estimate": "600MiB"}
        for name in ("a", "b", "c")
    ]  # fmt: skip
    gateway, url, _ = await pooled(fleet(tmp_path, models, {"cpu_bytes": "1000MiB"}))
    async with aiohttp.ClientSession() as session:
        for name in ("a", "b"):
            assert (await request(session, url, name))[0] == 200
            await wait_for(lambda n=name: gateway.residency.models[n].footprint.measured, 5)
    return gateway, url


async def test_a_parked_floor_estimated_above_the_measured_footprint_is_not_counted_on(
    pooled, tmp_path
):
    # measured awake at 300 MiB, their parked floor still the 512 MiB estimate (an estimate of
    # 600 MiB, engines that do not say what a park releases): the third copy in 1000 MiB stops
    # the least recent one; parking would free nothing as planned (and once counted the floor
    # above the awake footprint: both were stopped)
    gateway, url = await small_copies_with_two_awake(pooled, tmp_path)
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "c"))[0] == 200
        assert states(gateway, "a") == [] and states(gateway, "b") == [S.READY]


async def test_a_floor_never_measured_is_estimated_from_what_a_park_releases(pooled, tmp_path):
    # as above, but the engines report 200 MiB of weights: parked, they will hold ~100 MiB, so
    # the least recent one is parked, not stopped
    gateway, url = await small_copies_with_two_awake(
        pooled, tmp_path, "--weights-bytes", str(200 * MiB)
    )
    assert gateway.residency.models["a"].footprint.parked_bytes == 100 * MiB
    async with aiohttp.ClientSession() as session:
        assert (await request(session, url, "c"))[0] == 200
        assert states(gateway, "a") == [S.PARKED] and states(gateway, "b") == [S.READY]
