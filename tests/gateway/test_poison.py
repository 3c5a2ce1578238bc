"""Poison requests (gateway/proxy/quarantine.py) with fake engine processes that a request can
kill: the request is answered 502 ``request_crashed_engine`` after its retry on probation crashed
the engine too, then refused unsent whoever sends it; the bystanders of those crashes (identical
bodies included) are answered; a crash mid-stream ends the stream with its error event. And the
memory itself: its suspects and poison signatures are bounded and forgotten after their TTL."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest

from gateway.engines.replica import ReplicaState
from gateway.limits import NO_LIMITS
from gateway.metrics import GatewayMetrics
from gateway.proxy import quarantine as quarantine_module
from gateway.proxy.exchange import Exchange
from gateway.proxy.quarantine import Quarantine, Signatures
from tests.gateway.conftest import model_route, seat
from tests.gateway.test_residency import fleet, sample, states
from tests.gateway.test_resilience import sse_events, wait_for

S = ReplicaState


async def send(session, url: str, stream: bool = False, **mock) -> tuple[int, object]:
    """(status, the JSON answer or, for a started stream, its SSE events)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mock": mock}
    if stream:
        body["stream"] = True
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.content_type == "text/event-stream":
            return resp.status, sse_events(await resp.text())
        return resp.status, await resp.json()


def code(answer) -> str:
    return answer["error"]["code"]


def poison_count(gateway, result: str) -> float:
    return sample(gateway, "modelyard_poison_requests_total", model="m", result=result)


async def engine_requests(session, replica) -> int:
    async with session.get(replica.url + "/stats") as resp:
        return (await resp.json())["requests"]


@pytest.fixture
async def single(pooled, tmp_path):
    """A gateway with one pinned model 'm' on one fake engine, ready."""
    gateway, url, _ = await pooled(fleet(tmp_path, [{"name": "m"}]))
    await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    return gateway, url


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_that_crashes_its_engine_twice_is_refused_unsent(single, stream):
    gateway, url = single
    replica = gateway.pool.replicas["m"][0]
    async with aiohttp.ClientSession() as session:
        status, answer = await send(session, url, stream, fail="crash")
        assert status == 502 and code(answer) == "request_crashed_engine"
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        await wait_for(lambda: replica.restarts == 2, timeout=10)  # fresh, then on probation
        await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
    async with aiohttp.ClientSession() as other_client:  # the same body from someone else
        status, answer = await send(other_client, url, stream, fail="crash")
        assert status == 502 and code(answer) == "request_crashed_engine"
        assert await engine_requests(other_client, replica) == 0  # never forwarded
        assert (await send(other_client, url, stream))[0] == 200  # other requests are served
    assert replica.restarts == 2 and states(gateway, "m") == [S.READY]
    assert [poison_count(gateway, r) for r in ("suspect", "marked", "refused")] == [1, 1, 1]


async def test_the_bystanders_of_a_poison_request_are_answered(single):
    """Three identical requests in flight when a poison one crashes the engine are retried, one at
    a time, and answered; their body is not blamed for sharing the crash."""
    gateway, url = single
    replica = gateway.pool.replicas["m"][0]
    backend = replica.backend
    async with aiohttp.ClientSession() as session:
        bystanders = [asyncio.create_task(send(session, url, delay_ms=1000)) for _ in range(3)]
        await wait_for(lambda: backend.outstanding == 3, timeout=5)
        status, answer = await send(session, url, fail="crash")
        assert status == 502 and code(answer) == "request_crashed_engine"
        assert [status for status, _ in await asyncio.gather(*bystanders)] == [200] * 3
        assert [poison_count(gateway, r) for r in ("suspect", "cleared", "marked")] == [4, 3, 1]
        await wait_for(lambda: replica.restarts == 2, timeout=10)
        await wait_for(lambda: states(gateway, "m") == [S.READY], timeout=15)
        assert (await send(session, url, delay_ms=1000))[0] == 200
    assert poison_count(gateway, "cleared") == 3  # that body is no suspect any more
    assert replica.restarts == 2


async def test_a_crash_mid_stream_ends_the_stream_then_blames_the_request(single):
    gateway, url = single
    replica = gateway.pool.replicas["m"][0]
    async with aiohttp.ClientSession() as session:
        for crashes, expected in ((1, "engine_crashed"), (2, "request_crashed_engine")):
            status, events = await send(session, url, stream=True, fail="crash_mid_stream")
            assert status == 200 and "[DONE]" not in events
            assert json.loads(events[-1])["error"]["code"] == expected

            def restarted(crashes: int = crashes) -> bool:
                return replica.restarts == crashes and states(gateway, "m") == [S.READY]

            await wait_for(restarted, timeout=15)
        status, answer = await send(session, url, stream=True, fail="crash_mid_stream")
        assert status == 502 and code(answer) == "request_crashed_engine"
    assert replica.restarts == 2


def exchange(body: bytes) -> Exchange:
    route = model_route()
    return Exchange("rid", "/v1/completions", body, False, False, route, NO_LIMITS, seat(route))


async def test_suspects_run_one_at_a_time_and_the_second_crash_blames_the_one_running():
    crashes = [True]  # what the next judge sees

    async def engine_crashed(backend) -> bool:
        return crashes.pop(0)

    metrics = GatewayMetrics()
    quarantine = Quarantine(metrics, engine_crashed)
    backend = model_route().backends[0]
    first, second, fresh = exchange(b"a"), exchange(b"b"), exchange(b"c")
    for ex in (first, second):
        crashes.append(True)
        assert (await quarantine.judge(ex, backend)).reason == "engine_crashed"
    await quarantine.admit(first)
    waiting = asyncio.create_task(quarantine.admit(second))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the other suspect waits for its turn
    await quarantine.admit(fresh)  # a request that is no suspect runs at once
    assert fresh.probation is None
    assert (await quarantine.judge(first, backend)).reason == "request_crashed_engine"
    assert quarantine.refusal(exchange(b"a")) is not None  # poison, whoever sends it
    quarantine.release(first)
    await asyncio.wait_for(waiting, 1)
    quarantine.answered(second)  # answered on probation: cleared
    quarantine.release(second)
    await quarantine.admit(exchange(b"b"))
    assert quarantine.refusal(exchange(b"b")) is None and b"b" not in quarantine.suspects


def test_signatures_are_bounded_and_forgotten_after_their_ttl(monkeypatch):
    monkeypatch.setattr(quarantine_module, "MAX_SIGNATURES", 3)
    now = [1000.0]
    monkeypatch.setattr(quarantine_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    signatures = Signatures()
    for name in (b"a", b"b", b"c", b"d"):
        signatures.add(name)
        now[0] += 1
    assert b"a" not in signatures and all(s in signatures for s in (b"b", b"c", b"d"))
    signatures.add(b"b")  # seen again: remembered anew
    now[0] += quarantine_module.TTL_S - 0.5  # "c" and "d" expire, the renewed "b" does not
    assert b"b" in signatures and b"c" not in signatures and b"d" not in signatures
    now[0] += 1
    assert not signatures
