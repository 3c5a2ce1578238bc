"""Failures with real upstream processes: SIGKILL under traffic, ejection and re-admission,
retries, mid-stream death, every timeout kind, client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import aiohttp
import pytest

from common.net import free_port
from gateway.backend import Condition
from tests.gateway.conftest import fleet


def sse_events(text: str) -> list[str]:
    return [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]


async def wait_for(predicate, timeout: float = 5.0, step: float = 0.01) -> float:
    """Seconds until predicate() held; fails the test after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)
    return time.monotonic() - start


async def test_sigkill_under_traffic_retries_ejects_and_readmits(start_gateway, spawn_upstream):
    a, b = spawn_upstream("m1"), spawn_upstream("m1")
    gw = await start_gateway(fleet([a.url, b.url]))
    route = gw.gateway.router.resolve("m1")
    backend_a = next(x for x in route.backends if x.url == a.url)
    statuses: list[int] = []
    stop_at = time.monotonic() + 8.0  # bounded in time and count

    async def worker() -> None:
        for _ in range(60):
            if time.monotonic() > stop_at:
                return
            resp = await gw.chat(mock={"delay_ms": 15})
            await resp.read()
            statuses.append(resp.status)

    workers = [asyncio.create_task(worker()) for _ in range(8)]
    await asyncio.sleep(0.4)
    a.kill()
    ejected_after = await wait_for(lambda: not backend_a.available, timeout=2.0)
    await asyncio.gather(*workers)
    assert len(statuses) >= 200
    assert set(statuses) == {200}, [s for s in statuses if s != 200]
    assert ejected_after < 1.0
    assert (
        gw.gateway.metrics.retries.labels("m1", "disconnect")._value.get()
        + gw.gateway.metrics.retries.labels("m1", "connect")._value.get()
        >= 1
    )

    a.start()  # the same port again
    readmitted_after = await wait_for(lambda: backend_a.available, timeout=5.0)
    assert readmitted_after < 5.0
    before = a.stats()["requests"]
    resps = await asyncio.gather(*(gw.chat(mock={"delay_ms": 10}) for _ in range(20)))
    assert all(r.status == 200 for r in resps)
    assert a.stats()["requests"] > before  # traffic reaches the re-admitted backend


async def test_503_is_retried_on_another_replica_and_ejects(start_gateway, spawn_upstream):
    a, b = spawn_upstream("m1"), spawn_upstream("m1")
    a.control(fail=503)
    gw = await start_gateway(fleet([a.url, b.url]))
    resps = await asyncio.gather(*(gw.chat() for _ in range(20)))
    assert [r.status for r in resps] == [200] * 20
    route = gw.gateway.router.resolve("m1")
    backend_a = next(x for x in route.backends if x.url == a.url)
    assert backend_a.ejected
    assert gw.gateway.metrics.retries.labels("m1", "status_503")._value.get() >= 1
    # Both failing: the last upstream error comes back, and only one of two is ejected.
    b.control(fail=503)
    backend_a.set_condition(Condition.EJECTED, False)
    for _ in range(6):
        resp = await gw.chat()
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "mock failure 503"
    assert sum(1 for x in route.backends if x.ejected) == 1


async def test_stream_passes_through_and_handles_usage(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    # The client did not ask for usage: the gateway asks upstream, reads it, strips it.
    resp = await gw.chat(stream=True, max_tokens=4)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "tok " * 4
    sent = fresh_upstreams[0].stats()["last_body"]
    assert sent["stream_options"] == {"include_usage": True}
    assert gw.gateway.metrics.completion_tokens.labels("m1")._value.get() == 4
    # The client asked for usage: it gets the usage chunk.
    resp = await gw.chat(stream=True, max_tokens=3, stream_options={"include_usage": True})
    chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_upstream_dying_mid_stream_gives_sse_error(start_gateway, spawn_upstream):
    a = spawn_upstream("m1")
    a.control(fail="die_mid_stream")
    gw = await start_gateway(fleet([a.url]))
    resp = await gw.chat(stream=True, max_tokens=10)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert len(events) == 3 and "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "upstream_disconnected"
    # A stream that ends without [DONE] is not a silent cut either.
    a.control(fail="no_done")
    events = sse_events(await (await gw.chat(stream=True, max_tokens=2)).text())
    assert json.loads(events[-1])["error"]["code"] == "upstream_stream_cut"


def _black_hole() -> tuple[socket.socket, list[socket.socket], int]:
    """A listening socket whose accept queue is full, so new connections hang in SYN."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    return server, fillers, port


async def test_connect_timeout(start_gateway):
    server, fillers, port = _black_hole()
    try:
        gw = await start_gateway(
            fleet(
                [f"http://127.0.0.1:{port}"],
                timeouts={"connect_s": 0.2},
                health={"interval_s": 60, "timeout_s": 0.2},
            )
        )
        route = gw.gateway.router.resolve("m1")
        await wait_for(lambda: route.backends[0].check_fail_streak >= 1, timeout=3.0)
        # keep routing to it despite the failing first check
        route.backends[0].set_condition(Condition.UNHEALTHY, False)
        start = time.monotonic()
        resp = await gw.chat()
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_connect_timeout"
        assert time.monotonic() - start < 1.5
    finally:
        for s in (server, *fillers):
            s.close()


@pytest.mark.parametrize(
    ("timeouts", "mock", "stream", "expected"),
    [
        ({"first_byte_s": 0.3}, {"delay_ms": 3000}, False, "upstream_timeout_first_byte"),
        ({"first_byte_s": 0.3}, {"delay_ms": 3000}, True, "upstream_timeout_first_byte"),
        ({"first_byte_s": 5, "total_s": 0.3}, {"delay_ms": 3000}, False, "upstream_timeout_total"),
    ],
)
async def test_timeouts_before_first_byte_are_504(
    start_gateway, fresh_upstreams, timeouts, mock, stream, expected
):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], timeouts=timeouts))
    start = time.monotonic()
    resp = await gw.chat(stream=stream, mock=mock)
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == expected
    assert time.monotonic() - start < 1.5
    kind = expected.rsplit("_", 1)[-1] if "total" in expected else "first_byte"
    assert gw.gateway.metrics.timeouts.labels("m1", kind)._value.get() == 1


@pytest.mark.parametrize(
    ("timeouts", "mock", "expected"),
    [
        ({"idle_s": 0.3}, {"chunk_delay_ms": 2000, "tokens": 3}, "upstream_timeout_idle"),
        (
            {"idle_s": 5, "total_s": 0.6},
            {"chunk_delay_ms": 150, "tokens": 40},
            "upstream_timeout_total",
        ),
    ],
)
async def test_timeouts_mid_stream_are_sse_errors(
    start_gateway, fresh_upstreams, timeouts, mock, expected
):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], timeouts=timeouts))
    start = time.monotonic()
    resp = await gw.chat(stream=True, mock=mock)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert time.monotonic() - start < 2.0
    assert json.loads(events[0])["choices"]
    assert json.loads(events[-1])["error"]["code"] == expected


async def test_client_disconnect_closes_upstream(start_gateway, fresh_upstreams):
    up = fresh_upstreams[0]
    gw = await start_gateway(fleet([up.url]))
    before = up.stats()
    # A stream: read one chunk, then hang up.
    async with aiohttp.ClientSession() as client:
        resp = await client.post(
            gw.url + "/v1/chat/completions",
            json={
                "model": "m1",
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
                "mock": {"chunk_delay_ms": 100, "tokens": 100},
            },
        )
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
    await wait_for(
        lambda: up.stats()["streams_aborted"] > before["streams_aborted"], timeout=2.0, step=0.05
    )
    # A unary request still waiting for its answer.
    async with aiohttp.ClientSession() as client:
        task = asyncio.create_task(
            client.post(
                gw.url + "/v1/chat/completions",
                json={
                    "model": "m1",
                    "messages": [{"role": "user", "content": "x"}],
                    "mock": {"delay_ms": 5000},
                },
            )
        )
        await asyncio.sleep(0.3)
        task.cancel()
    await wait_for(
        lambda: up.stats()["requests_cancelled"] > before["requests_cancelled"] + 1,
        timeout=2.0,
        step=0.05,
    )
    route = gw.gateway.router.resolve("m1")
    await wait_for(lambda: route.inflight == 0 and route.backends[0].outstanding == 0, 2.0)


async def test_dead_single_upstream_is_502(start_gateway):
    port = free_port()  # nothing listens there
    gw = await start_gateway(fleet([f"http://127.0.0.1:{port}"], health={"interval_s": 60}))
    route = gw.gateway.router.resolve("m1")
    await wait_for(lambda: route.backends[0].check_fail_streak >= 1, timeout=3.0)
    # keep routing to it despite the failing first check
    route.backends[0].set_condition(Condition.UNHEALTHY, False)
    resp = await gw.chat()
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "upstream_connect_error"
    resp = await gw.chat(stream=True)
    assert resp.status in (502, 503)  # 503 once passive detection ejected the backend


async def test_requests_waiting_on_an_ejected_backend_are_retried(start_gateway, spawn_upstream):
    slow, fast = spawn_upstream("m1"), spawn_upstream("m1")
    slow.control(delay_ms=5000)
    gw = await start_gateway(fleet([slow.url, fast.url]))
    route = gw.gateway.router.resolve("m1")
    backend = next(b for b in route.backends if b.url == slow.url)
    start = time.monotonic()
    tasks = [asyncio.create_task(gw.chat()) for _ in range(8)]
    await wait_for(lambda: len(backend.waiting) >= 1, timeout=2.0)
    # Failures seen on other requests eject it: the requests waiting there move on.
    for _ in range(2):
        gw.gateway.health.record_failure(route, backend)
    assert backend.ejected
    resps = await asyncio.gather(*tasks)
    assert [r.status for r in resps] == [200] * 8
    assert time.monotonic() - start < 3.0  # not the 5 s the slow backend would take
    assert gw.gateway.metrics.retries.labels("m1", "ejected")._value.get() >= 1
    assert backend.outstanding == 0 and not backend.waiting
