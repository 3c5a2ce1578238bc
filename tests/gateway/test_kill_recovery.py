"""Packed hosts survive the OOM killer (issue 31). An engine killed by a signal while it starts or
wakes is restarted after its backoff and its held requests are answered; only one that exits by
itself before it was ever ready is ``failed`` at once, and starts killed every time end ``failed``
after ``MAX_KILLED_STARTS``. A failed model refuses requests 503 ``model_failed`` until its
Retry-After (``queue.failed_retry_s``), then the next request tries it again, one try at a time.

First with fake engines (tests/gateway/fake_engine.py), rule by rule; then with real engines over
a tiny local Llama: SIGKILL during the start and during the wake, and a missing ``source``."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from common.net import free_port
from gateway.app import Gateway, create_app
from gateway.config import load_config
from gateway.engines import pool as pool_module
from gateway.engines.process import exit_reason
from gateway.engines.replica import Replica, ReplicaState
from gateway.residency import manager as manager_module
from tests.gateway.conftest import REPO_ROOT
from tests.gateway.serve_process import with_engine_logs
from tests.gateway.test_residency import fleet, on_demand, request, sample, states
from tests.gateway.test_resilience import wait_for

S = ReplicaState
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(manager_module, "PLAN_RETRY_S", 0.05)


@pytest.fixture
def spawns(monkeypatch) -> list[int]:
    """The pid of every engine the pool starts (exec'd or forked by its template), in order."""
    pids: list[int] = []
    real_start = pool_module.EnginePool._start_engine

    async def counted(pool, replica):
        proc = await real_start(pool, replica)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(pool_module.EnginePool, "_start_engine", counted)
    return pids


def transitions(gateway) -> list[tuple[ReplicaState, ReplicaState]]:
    """Every (old, new) replica transition from now on."""
    seen: list[tuple[ReplicaState, ReplicaState]] = []
    listener = gateway.pool.on_transition

    def record(replica: Replica, old: ReplicaState) -> None:
        seen.append((old, replica.state))
        listener(replica, old)

    gateway.pool.on_transition = record
    return seen


async def starting(gateway, name: str, after: list[int], count: int) -> Replica:
    """The model's replica once its ``count``-th engine is spawned and STARTING."""

    def spawned() -> bool:
        replicas = gateway.pool.replicas.get(name, [])
        return len(after) >= count and bool(replicas) and replicas[0].state is S.STARTING

    await wait_for(spawned, timeout=15)
    replica = gateway.pool.replicas[name][0]
    assert replica.proc is not None and replica.proc.pid == after[count - 1]
    return replica


def test_exit_reason_tells_a_signal_from_an_exit():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_reason(-200) == "killed by signal 200"
    assert exit_reason(3) == "exited with 3" and exit_reason(0) == "exited with 0"


# ---- the rules, with fake engines ----


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
async def test_a_start_killed_by_a_signal_is_restarted_and_its_held_requests_answered(
    pooled, tmp_path, spawns, sig
):
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", "--ready-delay-s", "1")]))
    seen = transitions(gateway)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        held = [asyncio.create_task(request(session, url, "od")) for _ in range(3)]
        replica = await starting(gateway, "od", spawns, 1)
        os.kill(replica.proc.pid, sig)  # what the OOM killer does to a load
        answers = await asyncio.gather(*held)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert gateway.pool.replicas["od"] == [replica] and replica.state is S.READY
    assert replica.restarts == 1 and len(spawns) == 2
    assert (S.STARTING, S.BACKOFF) in seen and (S.BACKOFF, S.FAILED) not in seen


async def test_a_start_that_exits_by_itself_before_ever_being_ready_fails_at_once(
    pooled, tmp_path, spawns
):
    """Killed on its first start, then exiting by itself on the second (a bad model): FAILED at
    that exit, not after MAX_CRASHES; its held requests are answered model_failed."""
    marker = tmp_path / "started"
    model = on_demand("od", "--ready-delay-s", "1", "--first-start-only", str(marker))
    gateway, url, _ = await pooled(fleet(tmp_path, [model]))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        held = asyncio.create_task(request(session, url, "od"))
        replica = await starting(gateway, "od", spawns, 1)
        await wait_for(marker.exists, timeout=10)
        os.kill(replica.proc.pid, signal.SIGKILL)
        status, answer, _ = await held
    assert status == 503 and answer["body"]["error"]["code"] == "model_failed"
    assert states(gateway, "od") == [S.FAILED] and replica.restarts == 1 and len(spawns) == 2
    assert "fake engine: cannot load the model" in replica.describe()["last_log_lines"]


async def test_starts_killed_every_time_end_failed_after_the_bound(
    pooled, tmp_path, spawns, monkeypatch
):
    monkeypatch.setattr(pool_module, "MAX_KILLED_STARTS", 3)
    monkeypatch.setattr(pool_module, "MAX_CRASHES", 1)  # kills do not count towards this one
    monkeypatch.setattr(pool_module, "BACKOFF_BASE_S", 0.05)
    gateway, url, _ = await pooled(fleet(tmp_path, [on_demand("od", "--ready-delay-s", "5")]))
    seen = transitions(gateway)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        held = asyncio.create_task(request(session, url, "od"))
        for start in (1, 2, 3):
            replica = await starting(gateway, "od", spawns, start)
            os.kill(replica.proc.pid, signal.SIGKILL)
        status, answer, _ = await held
    assert status == 503 and answer["body"]["error"]["code"] == "model_failed"
    assert states(gateway, "od") == [S.FAILED] and replica.restarts == 2 and len(spawns) == 3
    assert seen[-2:] == [(S.STARTING, S.BACKOFF), (S.BACKOFF, S.FAILED)]


async def test_an_engine_killed_while_waking_is_restarted_not_replaced(pooled, tmp_path, spawns):
    """The wake's POST /wake_up loses its connection a moment before the exit shows: the pool
    leaves the dead engine to its supervisor (BACKOFF, restart) rather than stopping it."""
    model = on_demand("od", "--wake-delay-s", "1", idle_ttl_s=600)
    gateway, url, _ = await pooled(fleet(tmp_path, [model]))
    seen = transitions(gateway)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        assert (await request(session, url, "od"))[0] == 200
        async with session.post(url + "/admin/models/od/park") as resp:
            assert resp.status == 200 and (await resp.json())["state"] == "parked"
        replica = gateway.pool.replicas["od"][0]
        held = [asyncio.create_task(request(session, url, "od")) for _ in range(3)]
        await wait_for(lambda: replica.state is S.WAKING, timeout=10)
        await asyncio.sleep(0.2)  # its /wake_up is in flight (the engine takes 1 s)
        os.kill(replica.proc.pid, signal.SIGKILL)
        answers = await asyncio.gather(*held)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert gateway.pool.replicas["od"] == [replica] and replica.state is S.READY
    assert replica.restarts == 1 and len(spawns) == 2
    assert (S.WAKING, S.BACKOFF) in seen and (S.WAKING, S.STOPPING) not in seen


async def test_a_failed_model_is_tried_again_once_per_retry_after(pooled, tmp_path, spawns):
    """Its source missing, the model fails; it refuses requests at once until its Retry-After,
    then the next request tries it again, holding the ones that come meanwhile (one start), and
    fails again with a fresh Retry-After; once the source is back, the next try serves."""
    doc = fleet(tmp_path, [on_demand("od", queue={"failed_retry_s": 2})])
    source = Path(doc["models"][0]["source"])
    gateway, url, _ = await pooled(doc)
    source.unlink()  # after the config check: the engine finds no model
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        status, answer, _ = await request(session, url, "od")
        assert status == 503 and answer["body"]["error"]["code"] == "model_failed"
        assert set(answer["body"]["error"]) == ERROR_KEYS
        assert answer["headers"]["Retry-After"] == "2" and len(spawns) == 1
        status, answer, took = await request(session, url, "od")  # before it: no start
        assert status == 503 and took < 1 and len(spawns) == 1
        assert answer["headers"]["Retry-After"] in ("1", "2")
        await asyncio.sleep(int(answer["headers"]["Retry-After"]))

        answers = await asyncio.gather(*(request(session, url, "od") for _ in range(4)))
        assert len(spawns) == 2  # one try for the four
        for status, answer, _ in answers:
            assert status == 503 and answer["body"]["error"]["code"] == "model_failed"
            assert answer["headers"]["Retry-After"] == "2"  # counted from the new failure
        assert states(gateway, "od") == [S.FAILED]

        source.write_bytes(b"GGUF")
        await asyncio.sleep(2)
        answers = await asyncio.gather(*(request(session, url, "od") for _ in range(4)))
        assert [status for status, _, _ in answers] == [200] * 4
        assert len(spawns) == 3 and states(gateway, "od") == [S.READY]
    assert sample(gateway, "modelyard_admission_refused_total", model="od",
                  reason="model_failed") == 6  # fmt: skip


async def test_a_failed_pinned_model_is_tried_again_too(pooled, tmp_path, spawns):
    marker = tmp_path / "started"
    marker.touch()  # every start fails, until it is gone
    model = {"name": "m", "engine_args": ["--first-start-only", str(marker)]}
    gateway, url, _ = await pooled(fleet(tmp_path, [{**model, "queue": {"failed_retry_s": 1}}]))
    await wait_for(lambda: states(gateway, "m") == [S.FAILED], timeout=10)
    marker.unlink()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        status, answer, _ = await request(session, url, "m")
        if status == 503:  # the Retry-After of the failure at start has not passed yet
            assert answer["body"]["error"]["code"] == "model_failed"
            await asyncio.sleep(int(answer["headers"]["Retry-After"]))
            status, answer, _ = await request(session, url, "m")
        assert status == 200, answer["body"]
    assert states(gateway, "m") == [S.READY] and len(spawns) == 2


# ---- real engines ----


@pytest.fixture
async def engines(tmp_path, monkeypatch):
    """start(models.yaml document, before=callable) → (gateway, url): an in-process gateway whose
    pool spawns real ``python -m engine`` processes (``before`` runs after the config check)."""
    monkeypatch.setattr(pool_module, "BACKOFF_BASE_S", 0.2)
    monkeypatch.setattr(pool_module, "READY_POLL_S", 0.05)
    runners: list[web.AppRunner] = []

    async def start(doc: dict, before=None):
        path = tmp_path / "models.yaml"
        path.write_text(yaml.safe_dump(with_engine_logs(doc, tmp_path / "engines")))
        config = load_config(path)
        if before is not None:
            before()
        gateway = Gateway(config, str(path), engine_cwd=str(REPO_ROOT))
        runner = web.AppRunner(create_app(gateway), handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return gateway, f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()  # stops the engines it started


def real_model(name: str, source: Path, **keys) -> dict:
    return {
        "name": name,
        "source": str(source),
        "device": "cpu",
        "max_model_len": 256,
        "max_num_seqs": 4,
        "kv_cache_memory": "64MiB",
        "engine_args": ["--num-threads", "1"],
        "residency": "on_demand",
        "idle_ttl_s": 600,
        **keys,
    }


async def complete(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        answer = await resp.json()
        return resp.status, answer["choices"][0]["text"] if resp.status == 200 else str(answer)


async def test_real_engine_killed_while_starting_and_while_waking_serves_without_an_operator(
    engines, tiny_llama_dir, spawns
):
    doc = {"gateway": {"watch_config": False}, "models": [real_model("od", tiny_llama_dir)]}
    gateway, url = await engines(doc)
    seen = transitions(gateway)
    client = gateway.pool.client
    ready, post = client.ready, client.post

    async def not_the_first_engine(engine_url: str) -> bool:
        # the first engine is not seen ready before its kill, however fast it loads
        return len(spawns) > 1 and await ready(engine_url)

    async def killed_while_waking(engine_url: str, path: str, timeout_s: float):
        sent = asyncio.create_task(post(engine_url, path, timeout_s))
        if path == "/wake_up":
            await asyncio.sleep(0.01)  # on its way, or being served
            os.kill(replica.proc.pid, signal.SIGKILL)
        return await sent

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        client.ready = not_the_first_engine  # type: ignore[method-assign]
        held = [asyncio.create_task(complete(session, url, "od")) for _ in range(3)]
        replica = await starting(gateway, "od", spawns, 1)
        await wait_for(lambda: any("loading model" in line for line in replica.log.tail(50)), 60)
        assert replica.state is S.STARTING
        os.kill(replica.proc.pid, signal.SIGKILL)  # while it loads its weights
        answers = await asyncio.wait_for(asyncio.gather(*held), 120)
        client.ready = ready  # type: ignore[method-assign]
        assert [status for status, _ in answers] == [200] * 3, answers
        assert replica.state is S.READY and replica.restarts == 1 and len(spawns) == 2
        assert (S.STARTING, S.BACKOFF) in seen

        async with session.post(url + "/admin/models/od/park") as resp:
            assert resp.status == 200 and (await resp.json())["state"] == "parked"
        client.post = killed_while_waking  # type: ignore[method-assign]
        woken = [asyncio.create_task(complete(session, url, "od")) for _ in range(3)]
        again = await asyncio.wait_for(asyncio.gather(*woken), 120)
        client.post = post  # type: ignore[method-assign]
        assert again == answers  # greedy: the restarted engine answers the same
        assert gateway.pool.replicas["od"] == [replica] and replica.state is S.READY
        assert replica.restarts == 2 and len(spawns) == 3
        assert (S.WAKING, S.BACKOFF) in seen
    assert not any(new is S.FAILED for _, new in seen)


async def test_real_engine_with_a_missing_source_fails_with_its_log_and_retries_per_retry_after(
    engines, tmp_path, spawns
):
    source = tmp_path / "gone.gguf"
    source.write_bytes(b"GGUF")
    model = real_model("bad", source, queue={"failed_retry_s": 2})
    gateway, url = await engines(
        {"gateway": {"watch_config": False}, "models": [model]}, before=source.unlink
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def refused() -> tuple[Replica, float]:
            """Refused model_failed, the engine's own words in /admin/models."""
            started = time.monotonic()
            status, answer = await complete(session, url, "bad")
            took = time.monotonic() - started
            assert status == 503 and "model_failed" in answer
            listing = await (await session.get(url + "/admin/models")).json()
            (info,) = listing["models"]
            assert info["state"] == "failed"
            assert any("no such file or directory" in line
                       for line in info["replicas"][0]["last_log_lines"])  # fmt: skip
            (replica,) = gateway.pool.replicas["bad"]
            return replica, took

        async def retry_after() -> str:
            body = {"model": "bad", "prompt": "hi", "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert set((await resp.json())["error"]) == ERROR_KEYS
                return resp.headers["Retry-After"]

        first, _ = await refused()
        assert len(spawns) == 1
        same, took = await refused()  # within its Retry-After: at once, no new start
        assert same is first and took < 1 and len(spawns) == 1
        wait = await retry_after()
        assert wait in ("1", "2")
        await asyncio.sleep(int(wait))
        second, _ = await refused()  # tried again: a new replica, failed again
        assert second is not first and second.restarts == 0 and len(spawns) == 2
        assert await retry_after() == "2"  # a fresh one, from the new failure
