"""Admission through a running gateway (mock upstreams and fake engines): a model admits its
slots and the rest wait in its line; the line bounds the wait and the count, sheds sheddable keys
first (429 with a Retry-After) and drops a sheddable waiter for a request that may not be shed;
a slot comes back whatever ends the request (a client that leaves while waiting or streaming,
an upstream error, a retry); streamed tokens are charged as they pass and corrected by the
usage; and a model that loads has the same one line, in the same order, as a busy one."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.admission.scheduler import Tenant
from tests.gateway.conftest import fleet
from tests.gateway.test_residency import fleet as local_fleet
from tests.gateway.test_residency import on_demand, sample
from tests.gateway.test_resilience import wait_for

SECRETS = {"normal": "sk-normal", "batch": "sk-batch", "vip": "sk-vip"}
KEYS = {f"{name.upper()}_KEY": secret for name, secret in SECRETS.items()}  # the environment
KEY_CONFIG = [
    {"name": "normal", "key_env": "NORMAL_KEY"},
    {"name": "batch", "key_env": "BATCH_KEY", "sheddable": True},
    {"name": "vip", "key_env": "VIP_KEY", "priority": 1},
]


def keyed(doc: dict) -> dict:
    doc["gateway"]["auth"] = {"keys": KEY_CONFIG}
    return doc


def one_model(upstream: str, slots: int, policy: str = "fair", **model) -> dict:
    doc = fleet([upstream])
    doc["models"][0].update(admission={"max_in_flight": slots, "policy": policy}, **model)
    return doc


async def send(
    http: aiohttp.ClientSession, url: str, key: str | None = None, model: str = "m1", **mock
) -> tuple[int, dict, dict, float]:
    """(status, JSON body, headers, seconds) of one chat completion."""
    headers = {"Authorization": f"Bearer {SECRETS[key]}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "mock": mock}
    started = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers), time.monotonic() - started


def line(gw, model: str = "m1"):
    return gw.gateway.admission.lines[model]


def access_log(gw) -> list[dict]:
    gw.gateway.access_log.flush()
    return [json.loads(entry) for entry in gw.gateway.access_log.stream.getvalue().splitlines()]


async def test_a_model_admits_its_slots_and_the_rest_wait_in_their_order(
    start_gateway, fresh_upstreams
):
    gw = await start_gateway(one_model(fresh_upstreams[0].url, 2, policy="fcfs"))
    gw.gateway.access_log.stream = io.StringIO()
    started = time.monotonic()

    async def finished_at() -> float:
        assert (await send(gw.http, gw.url, delay_ms=300))[0] == 200
        return time.monotonic() - started

    tasks = []
    for _ in range(5):
        tasks.append(asyncio.create_task(finished_at()))
        await asyncio.sleep(0.02)  # arrival order
    await wait_for(lambda: line(gw).waiting == 3, timeout=5)
    assert gw.gateway.router.resolve("m1").inflight == 2
    assert sample(gw.gateway, "modelyard_admission_queue_depth", model="m1", band="0") == 3
    done = await asyncio.gather(*tasks)
    assert max(done[:2]) < 0.5 < min(done[2:4]) <= max(done[2:4]) < 0.8 < done[4]  # 3 rounds
    entries = sorted(access_log(gw), key=lambda e: e["queue_position"])
    assert [e["queue_position"] for e in entries] == [0, 0, 0, 1, 2]
    assert [e["queue_wait_ms"] > 250 for e in entries] == [False, False, True, True, True]
    assert line(gw).scheduler.in_flight == 0


async def test_a_client_that_leaves_frees_its_place_or_its_slot(start_gateway, fresh_upstreams):
    gw = await start_gateway(one_model(fresh_upstreams[0].url, 1))
    busy = asyncio.create_task(send(gw.http, gw.url, delay_ms=400))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as impatient:
        with pytest.raises(TimeoutError):
            await send(impatient, gw.url)  # leaves while waiting
    await wait_for(lambda: line(gw).waiting == 0, timeout=2)
    assert sample(gw.gateway, "modelyard_admission_queue_depth", model="m1", band="0") == 0
    assert (await busy)[0] == 200
    # and one that leaves mid-stream gives its slot back (the upstream's stream is cut)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "mock": {"tokens": 50, "chunk_delay_ms": 50}}  # fmt: skip
    async with gw.http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readany()
        assert line(gw).scheduler.in_flight == 1
    await wait_for(lambda: line(gw).scheduler.in_flight == 0, timeout=2)
    status, *_ = await send(gw.http, gw.url)
    assert status == 200 and line(gw).scheduler.in_flight == 0


async def test_a_request_waits_at_most_max_wait_s(start_gateway, fresh_upstreams):
    gw = await start_gateway(one_model(fresh_upstreams[0].url, 1, queue={"max_wait_s": 0.3}))
    busy = asyncio.create_task(send(gw.http, gw.url, delay_ms=800))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    status, body, headers, took = await send(gw.http, gw.url)
    assert status == 503 and 0.25 < took < 0.7
    assert body["error"]["code"] == "queue_timeout"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert int(headers["Retry-After"]) >= 1
    assert (await busy)[0] == 200
    assert sample(gw.gateway, "modelyard_admission_refused_total", model="m1",
                  reason="queue_timeout") == 1  # fmt: skip


async def test_sheddable_keys_are_refused_first(start_gateway, fresh_upstreams):
    doc = keyed(one_model(fresh_upstreams[0].url, 1, queue={"max_requests": 1}))
    gw = await start_gateway(doc, env=KEYS)
    busy = asyncio.create_task(send(gw.http, gw.url, "normal", delay_ms=600))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    shed_later = asyncio.create_task(send(gw.http, gw.url, "batch"))
    await wait_for(lambda: line(gw).waiting == 1, timeout=5)
    # a full line: the sheddable arrival is refused, 429 with a Retry-After...
    status, body, headers, _ = await send(gw.http, gw.url, "batch")
    assert status == 429 and body["error"]["code"] == "request_shed"
    assert body["error"]["type"] == "rate_limit_error"
    assert headers["Retry-After"] == "5"  # nothing completed yet: the drain is unmeasured
    # ...a non-sheddable one takes the sheddable waiter's place, which is answered 429...
    kept = asyncio.create_task(send(gw.http, gw.url, "normal"))
    status, body, _, _ = await shed_later
    assert status == 429 and body["error"]["code"] == "request_shed"
    # ...and with nobody left to shed, the next non-sheddable one is refused: 503
    status, body, headers, _ = await send(gw.http, gw.url, "normal")
    assert status == 503 and body["error"]["code"] == "queue_full"
    assert [(await task)[0] for task in (busy, kept)] == [200, 200]
    shed = {key: sample(gw.gateway, "modelyard_admission_shed_total", model="m1", key=key)
            for key in ("batch", "normal")}  # fmt: skip
    assert shed == {"batch": 2, "normal": 0}
    assert sample(gw.gateway, "modelyard_admission_refused_total", model="m1",
                  reason="request_shed") == 2  # fmt: skip


async def test_retry_after_comes_from_the_drain_rate_and_the_work_ahead(
    start_gateway, fresh_upstreams
):
    doc = keyed(one_model(fresh_upstreams[0].url, 1, queue={"max_requests": 2}))
    gw = await start_gateway(doc, env=KEYS)
    for _ in range(3):  # measured: one completion every 0.6 s
        assert (await send(gw.http, gw.url, "normal", delay_ms=600))[0] == 200
    busy = asyncio.create_task(send(gw.http, gw.url, "normal", delay_ms=1000))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    waiting = [asyncio.create_task(send(gw.http, gw.url, "normal")) for _ in range(2)]
    await wait_for(lambda: line(gw).waiting == 2, timeout=5)
    # under fair, one round of the other key's requests goes before it: 1 ahead, then itself
    expected = line(gw).drain.retry_after_s(ahead=1)
    status, _, headers, _ = await send(gw.http, gw.url, "batch")
    assert status == 429 and headers["Retry-After"] == str(expected)
    assert expected == 2  # 2 completions at ~1.6/s, rounded up (unmeasured it would be 5)
    assert [(await t)[0] for t in (busy, *waiting)] == [200] * 3


async def test_a_higher_band_goes_before_the_waiting_lower_band(start_gateway, fresh_upstreams):
    gw = await start_gateway(keyed(one_model(fresh_upstreams[0].url, 1)), env=KEYS)
    gw.gateway.access_log.stream = io.StringIO()
    busy = asyncio.create_task(send(gw.http, gw.url, "normal", delay_ms=300))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    low = asyncio.create_task(send(gw.http, gw.url, "normal", delay_ms=300))
    await wait_for(lambda: line(gw).waiting == 1, timeout=5)
    high = asyncio.create_task(send(gw.http, gw.url, "vip", delay_ms=300))
    await wait_for(lambda: line(gw).waiting == 2, timeout=5)
    (_, *_, low_took), (_, *_, high_took) = await asyncio.gather(low, high)
    assert high_took < low_took  # it came later and was served first
    await busy
    waited = {e["key"]: e["queue_wait_ms"] for e in access_log(gw) if e["queue_wait_ms"] > 100}
    assert 200 < waited["vip"] < 450 and waited["normal"] > 500


async def test_errors_and_retries_give_the_slot_back(start_gateway, spawn_upstream):
    first, second = spawn_upstream("m1"), spawn_upstream("m1")
    doc = fleet([first.url, second.url])
    doc["models"][0]["admission"] = {"max_in_flight": 1}
    gw = await start_gateway(doc)
    for mock in ({"fail": 500}, {"fail": 429}, {"fail": "die"}, {}):
        for _ in range(3):
            await send(gw.http, gw.url, **mock)
    assert line(gw).scheduler.in_flight == 0 and line(gw).waiting == 0
    assert sample(gw.gateway, "modelyard_retries_total", model="m1", reason="disconnect") > 0


async def test_streamed_tokens_are_charged_as_they_pass_and_settled_by_the_usage(
    start_gateway, fresh_upstreams
):
    gw = await start_gateway(one_model(fresh_upstreams[0].url, 2))
    scheduler = line(gw).scheduler
    anonymous = Tenant("_anonymous")
    body = {"model": "m1", "messages": [{"role": "user", "content": "one two three"}],
            "stream": True, "mock": {"tokens": 20, "chunk_delay_ms": 30}}  # fmt: skip
    async with gw.http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        for _ in range(5):
            await resp.content.readany()
        midway = scheduler.counter(anonymous)
        await resp.read()
    await wait_for(lambda: scheduler.in_flight == 0, timeout=2)
    # the prompt estimate (4 per message + a quarter of its characters + 1 = 8) and the events
    # so far while it streamed; at the end the mock's usage: 3 prompt + 20 completion tokens
    assert 8 < midway < 8 + 20
    assert scheduler.counter(anonymous) == 3 + 20
    charged = sample(gw.gateway, "modelyard_admission_charged_tokens_total", model="m1",
                     key="_anonymous")  # fmt: skip
    assert charged == 23


async def test_loading_and_busy_wait_in_one_line_in_one_order(pooled, tmp_path, monkeypatch):
    """Requests that came while the model loaded and a higher-band one that came after it wait
    in the same line: the higher band goes first, then the others in order, one slot at a
    time."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    model = on_demand("od", "--ready-delay-s", "1.0", admission={"max_in_flight": 1})
    doc = local_fleet(tmp_path, [model])
    doc["gateway"]["auth"] = {"keys": KEY_CONFIG}
    gateway, url, _ = await pooled(doc)
    done: list[str] = []

    async def tracked(name: str, key: str) -> int:
        async with aiohttp.ClientSession() as session:
            status, *_ = await send(session, url, key, model="od", delay_ms=200)
        done.append(name)
        return status

    low = [asyncio.create_task(tracked(f"low{i}", "normal")) for i in range(2)]
    await wait_for(lambda: gateway.admission.waiting("od") == 2, timeout=5)
    high = asyncio.create_task(tracked("high", "vip"))
    statuses = await asyncio.gather(*low, high)
    assert statuses == [200] * 3
    assert done == ["high", "low0", "low1"]
    labels = {"model": "od", "key": "normal"}
    waited = gateway.metrics.registry.get_sample_value(
        "modelyard_admission_wait_seconds_sum", labels
    )
    assert waited > 2 * 1.0  # both waited for the load, the second one for a slot too


async def test_a_removed_model_refuses_its_waiting_requests(start_gateway, fresh_upstreams):
    doc = one_model(fresh_upstreams[0].url, 1)
    doc["models"].append({"name": "other", "upstreams": [fresh_upstreams[1].url]})
    gw = await start_gateway(doc)
    busy = asyncio.create_task(send(gw.http, gw.url, delay_ms=500))
    await wait_for(lambda: line(gw).scheduler.in_flight == 1, timeout=5)
    waiting = asyncio.create_task(send(gw.http, gw.url))
    await wait_for(lambda: line(gw).waiting == 1, timeout=5)
    doc["models"] = doc["models"][1:]
    Path(gw.path).write_text(json.dumps(doc))
    await gw.gateway.reload()
    status, body, *_ = await waiting
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert (await busy)[0] == 200  # in flight: answered
    assert "m1" not in gw.gateway.admission.lines
