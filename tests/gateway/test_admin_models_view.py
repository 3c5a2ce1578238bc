"""What ``GET /admin/models`` tells an operator's view (the status page) beyond states, with fake
engines: the latest replica failures with their reasons, and whether a ready replica is drained
by ``POST /admin/drain``."""

from __future__ import annotations

import os
import signal

import aiohttp

from gateway.engines import pool as pool_module
from gateway.engines.replica import ReplicaState
from tests.gateway.test_residency import fleet, states
from tests.gateway.test_resilience import wait_for

S = ReplicaState


async def test_recent_errors_and_a_drained_replica(pooled, tmp_path, monkeypatch):
    monkeypatch.setattr(pool_module, "RECENT_ERRORS", 2)
    gateway, url, _ = await pooled(fleet(tmp_path, [{"name": "m"}]))
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    async with aiohttp.ClientSession() as session:

        async def listing() -> dict:
            async with session.get(url + "/admin/models") as resp:
                return await resp.json()

        assert (await listing())["recent_errors"] == []
        (replica,) = gateway.pool.replicas["m"]
        for _ in range(3):  # the oldest failure is let go
            first = replica.proc
            os.kill(first.pid, signal.SIGKILL)
            await wait_for(
                lambda old=first: replica.proc is not old and replica.state is S.READY, 15
            )
        errors = (await listing())["recent_errors"]
        assert [(e["model"], e["replica"], e["from"], e["to"]) for e in errors] == [
            ("m", 0, "ready", "backoff")
        ] * 2
        assert all(e["reason"].startswith("killed by SIGKILL; restart in") for e in errors)
        assert errors[0]["time"] <= errors[1]["time"]

        (info,) = (await listing())["models"][0]["replicas"]
        assert info["draining"] is False
        body = {"backend": info["url"], "model": "m", "drain": True}
        async with session.post(url + "/admin/drain", json=body) as resp:
            assert resp.status == 200
        (info,) = (await listing())["models"][0]["replicas"]
        assert info["draining"] is True
