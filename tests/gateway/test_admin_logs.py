"""Each engine's output in its replica's log file, with fake engine processes: ``GET /admin/logs``
(plain text, its errors in OpenAI's shape), following a log live (SSE) across an engine's restart
and the file's rotation until the client leaves or the gateway stops, the file named per replica
in ``/admin/models``, and the gateway's own log keeping one line per engine event instead of the
engines' output. The admin key guards it, and admin answers are never cached."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from gateway.engines.replica import ReplicaState
from tests.gateway.test_residency import fleet, states
from tests.gateway.test_resilience import wait_for

S = ReplicaState
ERROR_KEYS = {"message", "type", "param", "code"}
ADMIN_KEY = "sk-admin-test-logs"


@pytest.fixture
async def running(pooled, tmp_path, monkeypatch, caplog):
    """A gateway with one pinned fake-engine model "m" (alias "m-alias"), READY, its log files
    rotating at 1 KiB, behind an admin key; and a session that sends the key."""
    monkeypatch.setenv("LOGS_ADMIN_KEY", ADMIN_KEY)
    doc = fleet(tmp_path, [{"name": "m", "aliases": ["m-alias"]}])
    doc["gateway"]["engine_logs"] = {"dir": str(tmp_path / "engine-logs"), "max_bytes": 1024}
    doc["gateway"]["auth"] = {"admin_key_env": "LOGS_ADMIN_KEY"}
    caplog.set_level(logging.INFO, "modelyard.pool")
    gateway, url, _ = await pooled(doc)
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        yield gateway, url, session


async def test_a_replicas_output_is_in_its_file_and_not_in_the_gateways_log(running, caplog):
    _, url, session = running
    async with session.get(url + "/admin/models") as resp:
        assert resp.headers["Cache-Control"] == "no-store"
        (replica,) = (await resp.json())["models"][0]["replicas"]
    path = Path(replica["log"])
    assert path.name == "replica-0.log" and path.parent.name == "m"
    await wait_for(lambda: "fake engine: loading" in path.read_text(), timeout=5)
    assert "==> modelyard" in path.read_text()  # the pool's start marker, before the engine's
    gateway_log = [r.getMessage() for r in [*caplog.get_records("setup"), *caplog.records]]
    assert not any("fake engine" in line for line in gateway_log)
    started = [line for line in gateway_log if "replica m#0: stopped -> starting" in line]
    assert len(started) == 1 and str(path) in started[0]
    assert any("replica m#0: starting -> ready" in line for line in gateway_log)

    async with session.get(url + "/admin/logs", params={"model": "m-alias"}) as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        assert resp.headers["Cache-Control"] == "no-store"
        text = await resp.text()
    assert text.endswith("\n") and "fake engine: loading" in text
    async with session.get(url + "/admin/logs", params={"model": "m", "tail": "1"}) as resp:
        assert (await resp.text()).count("\n") == 1


@pytest.mark.parametrize(
    ("params", "status", "param", "code"),
    [
        ({}, 400, "model", "invalid_value"),
        ({"model": "nope"}, 404, "model", "model_not_found"),
        ({"model": "m", "replica": "3"}, 404, "replica", "replica_not_found"),
        ({"model": "m", "replica": "one"}, 400, "replica", "invalid_value"),
        ({"model": "m", "replica": "-1"}, 400, "replica", "invalid_value"),
        ({"model": "m", "tail": "-5"}, 400, "tail", "invalid_value"),
        ({"model": "m", "tail": "10001"}, 400, "tail", "invalid_value"),
        ({"model": "m", "tail": "²"}, 400, "tail", "invalid_value"),
        ({"model": "m", "follow": "yes please"}, 400, "follow", "invalid_value"),
    ],
)
async def test_bad_queries_get_openai_errors(running, params, status, param, code):
    _, url, session = running
    async with session.get(url + "/admin/logs", params=params) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == ERROR_KEYS and (error["param"], error["code"]) == (param, code)


async def test_the_admin_key_guards_the_logs(running):
    _, url, _ = running
    async with aiohttp.ClientSession() as anonymous:
        for key in (None, "sk-wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with anonymous.get(
                url + "/admin/logs", params={"model": "m"}, headers=headers
            ) as resp:
                assert resp.status == 401
                assert resp.headers["Cache-Control"] == "no-store"


async def read_events(resp: aiohttp.ClientResponse, lines: list[str]) -> None:
    """Appends every SSE ``data:`` line of ``resp`` to ``lines`` until its stream ends."""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            lines.append(line[len("data: ") :])


async def test_following_a_log_sees_a_restart_and_rotations_until_the_client_leaves(running):
    gateway, url, session = running
    engine_log = gateway.pool.logs.replica("m", 0)
    seen: list[str] = []
    params = {"model": "m", "tail": "2", "follow": "1"}
    async with session.get(url + "/admin/logs", params=params) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-store"
        reader = asyncio.create_task(read_events(resp, seen))
        await wait_for(lambda: len(seen) == 2, timeout=5)  # the tail first
        assert seen == engine_log.tail(2) and "fake engine: loading" in seen[-1]
        (replica,) = gateway.pool.replicas["m"]
        first = replica.proc
        os.kill(first.pid, signal.SIGKILL)  # restarted after its backoff: the same file
        await wait_for(lambda: replica.proc is not first and replica.state is S.READY, 15)
        await wait_for(lambda: sum("fake engine: loading" in line for line in seen) == 2, 5)
        assert any("killed by SIGKILL" in line for line in seen)
        written = [f"line {i:04d} " + "y" * 60 for i in range(100)]  # 7 KiB: rotated 6 times
        for line in written:
            engine_log.write(line)
        await wait_for(lambda: seen[-1] == written[-1], timeout=5)
        assert seen[-100:] == written and Path(f"{engine_log.path}.2").exists()
        assert len(engine_log.followers) == 1
        reader.cancel()
    # the client left (its connection closed)
    await wait_for(lambda: not engine_log.followers, timeout=5)


async def test_a_followed_log_ends_when_the_gateway_stops(running):
    gateway, url, session = running
    seen: list[str] = []
    params = {"model": "m", "tail": "0", "follow": "1"}
    async with session.get(url + "/admin/logs", params=params) as resp:
        reader = asyncio.create_task(read_events(resp, seen))
        engine_log = gateway.pool.logs.replica("m", 0)
        await wait_for(lambda: len(engine_log.followers) == 1, timeout=5)
        engine_log.write("last words")
        gateway.pool.logs.end_following()  # what the app's on_shutdown does
        await asyncio.wait_for(reader, 5)  # the stream ended
    assert seen == ["last words"] and not engine_log.followers
