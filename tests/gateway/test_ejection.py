"""Passive ejection: what clients can provoke (an upstream's 500 to a bad body) never takes a
backend out on its own; a broken backend still goes as fast as before; a model's last available
backend is left to its active checks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.backend import Backend, Condition
from gateway.config import EjectionSettings, HealthSettings, parse_config
from gateway.health import HealthMonitor
from gateway.router import Router
from tests.gateway.conftest import fleet
from tests.gateway.test_resilience import wait_for

CHAT = "/v1/chat/completions"
KEYS = {"ATTACKER_KEY": "sk-attacker-secret", "VICTIM_KEY": "sk-victim-secret"}
SLOW_CHECKS = {"interval_s": 60, "timeout_s": 0.5, "unhealthy_after": 1, "healthy_after": 1}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def question(i: int) -> dict[str, Any]:
    """A valid request body, different for every ``i``."""
    return {"model": "m1", "messages": [{"role": "user", "content": f"question {i}"}]}


def poison(i: int) -> dict[str, Any]:
    """A body the upstream answers 500, different for every ``i``."""
    return {**question(i), "mock": {"fail": 500}}


def ejections(gw, backend: Backend) -> float:
    return gw.gateway.metrics.ejections.labels("m1", backend.label)._value.get()


async def status_of(gw, body: dict[str, Any], **kwargs: Any) -> int:
    resp = await gw.post(CHAT, body, **kwargs)
    await resp.read()
    return resp.status


def _monitor(backends: int, threshold: int, max_percent: float = 50) -> tuple[HealthMonitor, Any]:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(backends)]
    router = Router()
    router.apply(parse_config({"models": [{"name": "m1", "upstreams": urls}]}))
    ejection = EjectionSettings(consecutive_failures=threshold, base_s=5, max_percent=max_percent)
    monitor = HealthMonitor(router, None, HealthSettings(), ejection)  # type: ignore[arg-type]
    return monitor, router.resolve("m1")


async def test_repeated_signatures_do_not_count_distinct_ones_and_broken_answers_do():
    monitor, route = _monitor(backends=3, threshold=3)
    a, b, _ = route.backends
    for _ in range(10):  # one poison request, replayed
        monitor.record_failure(route, a, signature=1)
    assert (a.consecutive_failures, a.repeated_failures, a.ejected) == (1, 9, False)
    monitor.record_failure(route, a, signature=2)
    monitor.record_failure(route, a, signature=3)
    assert a.ejected  # three different requests failed
    monitor.record_failure(route, b, None)
    monitor.record_failure(route, b, signature=1)
    monitor.record_failure(route, b, signature=1)
    monitor.record_success(b)  # a success ends the streak
    assert (b.consecutive_failures, b.repeated_failures, b.failure_signatures) == (0, 0, set())
    for _ in range(3):  # connect errors, resets, timeouts: every one counts
        monitor.record_failure(route, b, None)
    assert not b.ejected  # max_percent 50 of 3: one at a time
    a.set_condition(Condition.EJECTED, False)
    for _ in range(3):
        monitor.record_failure(route, b, None)
    assert b.ejected


async def test_passive_evidence_never_ejects_the_last_available_backend():
    monitor, route = _monitor(backends=2, threshold=3, max_percent=100)
    down, last = route.backends
    down.set_condition(Condition.UNHEALTHY)  # its active checks failed
    for _ in range(10):
        monitor.record_failure(route, last, None)
    assert not last.ejected and last.available
    down.set_condition(Condition.UNHEALTHY, False)
    monitor.record_failure(route, last, None)
    assert last.ejected  # with another backend available, the same evidence ejects


@pytest.mark.parametrize("replicas", [1, 2])
async def test_one_clients_poison_bodies_eject_nothing(start_gateway, spawn_upstream, replicas):
    mocks = [spawn_upstream("m1") for _ in range(replicas)]
    doc = fleet([m.url for m in mocks])
    doc["gateway"]["auth"] = {
        "keys": [
            {"name": "attacker", "key_env": "ATTACKER_KEY"},
            {"name": "victim", "key_env": "VICTIM_KEY"},
        ]
    }
    gw = await start_gateway(doc, env=KEYS)
    backends = gw.gateway.router.resolve("m1").backends
    attacked: list[int] = []
    served: list[int] = []
    out: list[bool] = []  # any moment a backend was out of rotation
    done = asyncio.Event()

    async def attacker(n: int) -> None:  # a new bad body every time
        for _ in range(n):
            body = poison(len(attacked))
            attacked.append(await status_of(gw, body, headers=bearer(KEYS["ATTACKER_KEY"])))

    async def victim(n: int) -> None:
        for i in range(n):
            served.append(await status_of(gw, question(i), headers=bearer(KEYS["VICTIM_KEY"])))

    async def watch() -> None:
        while not done.is_set():
            out.append(not all(b.available for b in backends))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    await attacker(10)  # alone: no success of anyone else's ends its streak
    await asyncio.gather(attacker(30), victim(30))
    done.set()
    await watcher
    assert attacked == [500] * 40  # each reached the upstream and got its answer
    assert served == [200] * 30
    assert not any(out)
    assert [ejections(gw, b) for b in backends] == [0] * replicas
    assert sum(m.stats()["requests"] for m in mocks) == 70  # no retries of 500s


CLIENT_SECRETS = {f"K{i}_KEY": f"sk-client-{i}-secret" for i in range(3)}


def with_clients(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with three API keys, k0-k2 (secrets in CLIENT_SECRETS)."""
    doc["gateway"]["auth"] = {"keys": [{"name": f"k{i}", "key_env": f"K{i}_KEY"} for i in range(3)]}
    return doc


async def test_failing_answers_count_once_per_client_whatever_the_body(
    start_gateway, spawn_upstream
):
    up = spawn_upstream("m1")
    up.control(fail=500)
    doc = with_clients(fleet([up.url], ejection={"consecutive_failures": 10, "base_s": 5}))
    gw = await start_gateway(doc, env=CLIENT_SECRETS)
    backend = gw.gateway.router.resolve("m1").backends[0]
    for secret in CLIENT_SECRETS.values():
        assert await status_of(gw, question(0), headers=bearer(secret)) == 500
    assert (backend.consecutive_failures, backend.repeated_failures) == (3, 0)
    for i in range(1, 4):  # the same client, other bodies
        assert await status_of(gw, question(i), headers=bearer(CLIENT_SECRETS["K0_KEY"])) == 500
    assert (backend.consecutive_failures, backend.repeated_failures) == (3, 3)


@pytest.mark.parametrize("fail", [500, "die"])
async def test_a_broken_backend_is_ejected_as_fast_as_before(start_gateway, spawn_upstream, fail):
    """500 to every client's requests, or connections reset: with a replica to spare, ejected
    after exactly ``consecutive_failures`` failed requests, as before the poison-body rule."""
    broken, good = spawn_upstream("m1"), spawn_upstream("m1")
    broken.control(fail=fail)
    ejection = {"consecutive_failures": 3, "base_s": 5, "max_s": 5, "max_percent": 50}
    doc = with_clients(fleet([broken.url, good.url], ejection=ejection))
    gw = await start_gateway(doc, env=CLIENT_SECRETS)
    backend = next(b for b in gw.gateway.router.resolve("m1").backends if b.url == broken.url)
    secrets = list(CLIENT_SECRETS.values())
    statuses = []
    for i in range(60):
        if backend.ejected:
            break
        client = secrets[statuses.count(500) % 3]  # each failure another client's
        statuses.append(await status_of(gw, question(i), headers=bearer(client)))
    assert backend.ejected and ejections(gw, backend) == 1
    assert broken.stats()["requests"] == 3
    # 500s are the upstream's answer (not retried); a reset is retried on the good replica.
    assert statuses.count(500) == (3 if fail == 500 else 0)
    assert statuses.count(200) == len(statuses) - statuses.count(500)


async def test_the_last_backend_is_checked_at_once_instead_of_ejected(
    start_gateway, spawn_upstream
):
    up = spawn_upstream("m1")
    checks = up.stats()["health_checks"]  # the fixture's own, waiting for it to start
    gw = await start_gateway(fleet([up.url], health=SLOW_CHECKS))
    backend = gw.gateway.router.resolve("m1").backends[0]
    await wait_for(lambda: up.stats()["health_checks"] > checks, step=0.05)  # the start-up check
    up.control(fail="die", ready=False)
    assert [await status_of(gw, question(i)) for i in range(2)] == [502, 502]
    # Checks are a minute apart: only the check the failures called for can see it this soon.
    await wait_for(lambda: not backend.healthy, timeout=2.0)
    assert not backend.ejected and ejections(gw, backend) == 0
    resp = await gw.chat()
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "no_healthy_backend"


@pytest.mark.parametrize("fail", [500, "die"])
async def test_the_last_backend_stays_until_its_checks_fail_and_comes_back(
    start_gateway, spawn_upstream, fail
):
    up = spawn_upstream("m1")
    gw = await start_gateway(fleet([up.url]))  # checks every 0.2 s, out after one failure
    backend = gw.gateway.router.resolve("m1").backends[0]
    up.control(fail=fail)
    failed = 502 if fail == "die" else 500
    for i in range(10):  # five times the ejection threshold, all different requests
        assert await status_of(gw, question(i)) == failed
        assert backend.available
    assert ejections(gw, backend) == 0
    up.control(fail=fail, ready=False)
    await wait_for(lambda: not backend.available, timeout=3.0)
    resp = await gw.chat()
    assert resp.status == 503 and "Retry-After" in resp.headers
    up.control()
    await wait_for(lambda: backend.available, timeout=3.0)
    assert (await gw.chat()).status == 200
    assert not backend.ejected and ejections(gw, backend) == 0


async def test_repeated_500s_eject_when_the_check_agrees(start_gateway, spawn_upstream):
    """The same request failing again and again proves nothing alone, but it calls for an active
    check at once; a failing check ejects (here before ``unhealthy_after`` = 2 would)."""
    sick, good = spawn_upstream("m1"), spawn_upstream("m1")
    health = {**SLOW_CHECKS, "unhealthy_after": 2}
    checks = sick.stats()["health_checks"]
    gw = await start_gateway(fleet([sick.url, good.url], health=health))
    backend = next(b for b in gw.gateway.router.resolve("m1").backends if b.url == sick.url)
    await wait_for(lambda: sick.stats()["health_checks"] > checks, step=0.05)
    sick.control(fail=500, ready=False)
    for _ in range(40):  # identical requests until the sick one has had two (the threshold)
        if sick.stats()["requests"] >= 2:
            break
        await status_of(gw, question(0))
    await wait_for(lambda: backend.ejected, timeout=2.0)
    assert backend.healthy and ejections(gw, backend) == 1
