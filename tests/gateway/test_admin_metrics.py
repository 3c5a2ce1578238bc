"""Admin endpoints (reload, drain, backends) and metrics."""

from __future__ import annotations

import asyncio

import yaml

from tests.gateway.conftest import fleet


async def test_reload_applies_good_config_and_rejects_bad(start_gateway, fresh_upstreams):
    a, b = fresh_upstreams
    gw = await start_gateway(fleet([a.url]))
    backend_a = gw.gateway.router.resolve("m1").backends[0]
    backend_a.outstanding = 0
    new = fleet([a.url, b.url])
    new["models"].append({"name": "m2", "aliases": ["second"], "upstreams": [b.url]})
    gw.path.write_text(yaml.safe_dump(new))
    resp = await gw.http.post(gw.url + "/admin/reload")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["models"] == ["m1", "m2"]
    assert (await gw.chat("second")).status == 200
    route = gw.gateway.router.resolve("m1")
    assert route.backends[0] is backend_a  # unchanged backends keep their state
    assert len(route.backends) == 2
    # A bad edit is refused with the reason, and the running fleet stays as it was.
    broken = fleet([a.url])
    broken["models"][0]["upstreams"] = ["not a url"]
    gw.path.write_text(yaml.safe_dump(broken))
    resp = await gw.http.post(gw.url + "/admin/reload")
    assert resp.status == 400
    body = await resp.json()
    assert "models[0].upstreams[0]" in body["error"]["message"]
    assert body["error"]["code"] == "invalid_config"
    assert (await gw.chat("second")).status == 200
    assert len(gw.gateway.router.resolve("m1").backends) == 2
    metrics = (await (await gw.http.get(gw.url + "/metrics")).read()).decode()
    assert 'modelyard_config_reloads_total{result="rejected"} 1.0' in metrics
    # Removing a model: its name now gives 404.
    gw.path.write_text(yaml.safe_dump(fleet([a.url])))
    assert (await gw.http.post(gw.url + "/admin/reload")).status == 200
    assert (await gw.chat("second")).status == 404


async def test_drain_backend_and_gateway(start_gateway, fresh_upstreams):
    a, b = fresh_upstreams
    gw = await start_gateway(fleet([a.url, b.url]))
    label = a.url.split("://")[1]
    resp = await gw.http.post(gw.url + "/admin/drain", json={"backend": label})
    assert resp.status == 200
    before = a.stats()["requests"]
    resps = await asyncio.gather(*(gw.chat() for _ in range(10)))
    assert all(r.status == 200 for r in resps)
    assert a.stats()["requests"] == before  # drained: no new requests
    await gw.http.post(gw.url + "/admin/drain", json={"backend": a.url, "drain": False})
    state = await (await gw.http.get(gw.url + "/admin/backends")).json()
    assert all(x["available"] for x in state["models"][0]["backends"])
    assert (await gw.http.post(gw.url + "/admin/drain", json={"backend": "x:1"})).status == 404
    assert (await gw.http.post(gw.url + "/admin/drain", json={})).status == 200
    assert (await gw.http.get(gw.url + "/ready")).status == 503  # load balancers move away
    assert (await gw.chat()).status == 200  # but requests still work


async def test_metrics_exposition(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    for resp in (await gw.chat(max_tokens=2), await gw.chat(stream=True, max_tokens=2)):
        assert resp.status == 200
        await resp.read()  # the whole stream: it is counted when it ends
    assert (await gw.chat("unknown-model")).status == 404
    label = fresh_upstreams[0].url.split("://")[1]
    expected = [
        'modelyard_requests_total{code="200",model="m1"} 2.0',
        'modelyard_requests_total{code="404",model="_unknown"} 1.0',
        'modelyard_completion_tokens_total{model="m1"} 4.0',
        f'modelyard_backend_up{{backend="{label}",model="m1"}} 1.0',
        'modelyard_time_to_first_token_seconds_count{model="m1"} 1.0',
        'modelyard_requests_in_flight{model="m1"} 0.0',
    ]
    for _ in range(100):  # the stream's handler records it just after its last chunk went out
        text = (await (await gw.http.get(gw.url + "/metrics")).read()).decode()
        if all(line in text for line in expected):
            break
        await asyncio.sleep(0.02)
    for line in expected:
        assert line in text, line
    assert "modelyard_request_duration_seconds_bucket" in text
    assert "modelyard_upstream_latency_seconds_bucket" in text
