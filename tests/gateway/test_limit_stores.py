"""The Redis store and its on_error policy, in-process against a real redis-server: all-or-none
charges, refills on Redis's clock, usage corrections, expiry, headers, reloads, NOSCRIPT; and an
outage (killed or stalled) under each policy, logged once per transition, and the recovery."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis

from common.errors import RequestRefused
from gateway.config import parse_config
from gateway.limits import NO_LIMITS, RateLimited, RateLimiter, SharedLimits
from gateway.limits import shared as shared_module
from gateway.metrics import GatewayMetrics

PREFIX = "test:"


def config(url: str, on_error: str = "local", gateways: int = 2, **limits: int):
    return parse_config(
        {
            "gateway": {"state": {"redis_url": url, "key_prefix": PREFIX, "on_error": on_error,
                                  "gateways": gateways, "timeout_ms": 200}},
            "models": [{"name": "m1", "upstreams": ["http://127.0.0.1:9"], "limits": limits}],
        }
    )  # fmt: skip


@pytest.fixture
async def limiters(redis_server) -> AsyncIterator:
    """limiter(**limits) → a started RateLimiter on the test's Redis: one per gateway."""
    made: list[RateLimiter] = []

    async def limiter(on_error: str = "local", gateways: int = 2, **limits: int) -> RateLimiter:
        fleet = config(redis_server.url, on_error, gateways, **limits)
        assert fleet.gateway.state is not None
        made.append(RateLimiter(SharedLimits(fleet.gateway.state, GatewayMetrics())))
        made[-1].configure(fleet)
        await made[-1].start()
        return made[-1]

    yield limiter
    for limiter in made:
        await limiter.close()


@pytest.fixture
def db(redis_server) -> redis.Redis:
    return redis.Redis(port=redis_server.port, decode_responses=True)


def tokens(db: redis.Redis, bucket: str) -> float:
    return float(db.hget(PREFIX + bucket, "tokens"))


def metric(limiter: RateLimiter, name: str, *labels: str) -> float:
    assert limiter.shared is not None
    metric = getattr(limiter.shared.metrics, name)
    return (metric.labels(*labels) if labels else metric)._value.get()


async def hold_connections(limiter: RateLimiter, db: redis.Redis, count: int) -> None:
    """Admissions in flight together, each its own call, until the limiter's connection pool
    holds ``count`` connections."""
    for _ in range(20):
        calls = []
        for _ in range(count):
            calls.append(asyncio.ensure_future(limiter.admit(None, "m1", 0)))
            await asyncio.sleep(0)  # its batch leaves: the next admission starts another
        await asyncio.gather(*calls, return_exceptions=True)
        if sum(c["name"] == "modelyard-gateway" for c in db.client_list()) >= count:
            return
    raise AssertionError(f"fewer than {count} connections to Redis")


async def test_a_refusal_charges_no_bucket(limiters, db):
    limiter = await limiters(rpm=600, tpm=100)
    await limiter.admit(None, "m1", 90)
    assert tokens(db, "model:m1:requests") == pytest.approx(599, abs=0.1)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(None, "m1", 50)
    assert refused.value.limit == "model_tokens"
    assert refused.value.retry_after_s == pytest.approx(40 / (100 / 60), abs=0.1)
    assert tokens(db, "model:m1:requests") == pytest.approx(599, abs=0.1)  # not charged
    assert tokens(db, "model:m1:tokens") == pytest.approx(10, abs=0.1)


async def test_admissions_of_one_loop_turn_share_a_call(limiters, db):
    limiter = await limiters(rpm=80)
    calls = db.info("commandstats")["cmdstat_evalsha"]["calls"]
    answers = await asyncio.gather(
        *(limiter.admit(None, "m1", 0) for _ in range(100)), return_exceptions=True
    )
    # 100 admissions: two calls (MAX_BATCH is 64), each admission all or none, in order.
    assert db.info("commandstats")["cmdstat_evalsha"]["calls"] == calls + 2
    granted = [a for a in answers if not isinstance(a, RateLimited)]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in granted] == [
        str(79 - i) for i in range(80)
    ]
    assert all(isinstance(a, RateLimited) for a in answers[80:])
    assert tokens(db, "model:m1:requests") == pytest.approx(0, abs=0.1)


async def test_refills_run_on_redis_clock(limiters, db):
    limiter = await limiters(rpm=120)
    seconds, micros = db.time()
    # Emptied 30 s ago by Redis's clock: half of 120 is back, whatever this host's clock says.
    db.hset(
        PREFIX + "model:m1:requests",
        mapping={"tokens": 0, "ms": seconds * 1000 + micros / 1000 - 30_000},
    )
    grant = await limiter.admit(None, "m1", 0)
    assert int(grant.headers["x-ratelimit-remaining-requests"]) == 59
    assert float(grant.headers["x-ratelimit-reset-requests"][:-1]) == pytest.approx(30.5, abs=0.1)


async def test_usage_corrections_are_summed_into_one_call(limiters, db, monkeypatch):
    monkeypatch.setattr(shared_module, "FLUSH_S", 0.1)
    limiter = await limiters(tpm=6000)
    (await limiter.admit(None, "m1", 100)).settle(100)
    (await limiter.admit(None, "m1", 100)).settle(101)  # loads the correction script
    await asyncio.sleep(0.3)
    grants = [await limiter.admit(None, "m1", 100) for _ in range(10)]
    before = tokens(db, "model:m1:tokens")
    calls = db.info("commandstats")["cmdstat_evalsha"]["calls"]
    for grant in grants[:5]:
        grant.settle(300)  # each used 200 more than it was charged
    for grant in grants[5:]:
        grant.settle(50)  # and each of these 50 less
    await asyncio.sleep(0.3)
    assert db.info("commandstats")["cmdstat_evalsha"]["calls"] == calls + 1
    refilled = 100 * 0.3  # 6000/min for at most 0.3 s
    assert tokens(db, "model:m1:tokens") == pytest.approx(before - 1000 + 250, abs=refilled)
    # A refund never fills a bucket past its capacity.
    grant = await limiter.admit(None, "m1", 100)
    db.hset(PREFIX + "model:m1:tokens", "tokens", 5990)
    grant.settle(0)
    await asyncio.sleep(0.3)
    assert tokens(db, "model:m1:tokens") == 6000


async def test_buckets_expire_when_full_again(limiters, db):
    limiter = await limiters(rpm=60, tpm=6000)
    await limiter.admit(None, "m1", 3000)
    # Full again after (capacity - tokens) / rate, then a second more.
    assert db.pttl(PREFIX + "model:m1:requests") == pytest.approx(2000, abs=100)
    assert db.pttl(PREFIX + "model:m1:tokens") == pytest.approx(31000, abs=100)
    db.delete(PREFIX + "model:m1:requests")
    fast = await limiters(rpm=60_000)  # full again within 1 ms
    await fast.admit(None, "m1", 0)
    assert db.pttl(PREFIX + "model:m1:requests") == pytest.approx(1001, abs=50)
    deadline = time.monotonic() + 3
    while db.exists(PREFIX + "model:m1:requests") and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not db.exists(PREFIX + "model:m1:requests")


async def test_gateways_share_buckets_and_headers(limiters):
    a, b = await limiters(rpm=10), await limiters(rpm=10)
    for i in range(10):
        grant = await (a if i % 2 else b).admit(None, "m1", 0)
        assert grant.headers["x-ratelimit-limit-requests"] == "10"
        assert grant.headers["x-ratelimit-remaining-requests"] == str(9 - i)
    with pytest.raises(RateLimited) as refused:
        await a.admit(None, "m1", 0)
    headers = refused.value.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["Retry-After"] == "6"  # one request refills in 6 s at 10/min
    assert 5000 < int(headers["retry-after-ms"]) <= 6000
    assert 59 < float(headers["x-ratelimit-reset-requests"][:-1]) <= 60


async def test_a_reload_applies_new_allowances(limiters, redis_server):
    limiter = await limiters(rpm=100)
    assert (await limiter.admit(None, "m1", 0)).headers["x-ratelimit-remaining-requests"] == "99"
    limiter.configure(config(redis_server.url, rpm=10))
    grant = await limiter.admit(None, "m1", 0)
    assert grant.headers["x-ratelimit-limit-requests"] == "10"
    assert grant.headers["x-ratelimit-remaining-requests"] == "9"
    limiter.configure(config(redis_server.url))  # no limits left
    assert await limiter.admit(None, "m1", 0) is NO_LIMITS


async def test_scripts_load_again_after_redis_lost_them(limiters, db):
    limiter = await limiters(rpm=100)
    await limiter.admit(None, "m1", 0)
    db.script_flush()
    grant = await limiter.admit(None, "m1", 0)
    assert grant.headers["x-ratelimit-remaining-requests"] == "98"
    assert limiter.shared is not None and limiter.shared.up


async def test_the_password_comes_from_password_env(tmp_path, monkeypatch):
    from scripts.redis_server import RedisServer

    server = RedisServer(tmp_path, password="pw-from-env").start()
    try:
        monkeypatch.setenv("LIMITS_REDIS_PASSWORD", "pw-from-env")
        doc = {"gateway": {"state": {"redis_url": server.url, "gateways": 1,
                                     "password_env": "LIMITS_REDIS_PASSWORD"}},
               "models": [{"name": "m1", "upstreams": ["http://127.0.0.1:9"],
                           "limits": {"rpm": 5}}]}  # fmt: skip
        fleet = parse_config(doc)
        limiter = RateLimiter(SharedLimits(fleet.gateway.state, GatewayMetrics()))
        limiter.configure(fleet)
        await limiter.start()
        grant = await limiter.admit(None, "m1", 0)
        assert limiter.shared.up and grant.headers["x-ratelimit-remaining-requests"] == "4"
        await limiter.close()
    finally:
        server.kill()


@pytest.mark.parametrize("on_error", ["allow", "deny", "local"])
async def test_an_outage_goes_to_the_policy_and_back(limiters, redis_server, db, caplog, on_error):
    caplog.set_level(logging.WARNING, "modelyard.gateway")
    limiter = await limiters(on_error, gateways=2, rpm=10)
    await hold_connections(limiter, db, 3)
    redis_server.kill()
    started = time.monotonic()
    outcomes = []
    for _ in range(8):
        try:
            grant = await limiter.admit(None, "m1", 0)
            outcomes.append(grant.headers.get("x-ratelimit-limit-requests", "unchecked"))
        except RateLimited:
            outcomes.append("limited")
        except RequestRefused as refused:
            assert refused.status == 429 and refused.code == "rate_limits_unavailable"
            assert int(refused.headers["Retry-After"]) >= 1
            outcomes.append("denied")
    # Only the first call went to the dead Redis; the others asked nobody.
    assert time.monotonic() - started < 0.1
    assert metric(limiter, "rate_limit_store_errors", "connection") == 1
    assert metric(limiter, "rate_limit_fallbacks", on_error) == 8
    assert metric(limiter, "rate_limit_store_up") == 0
    assert (
        outcomes
        == {
            "allow": ["unchecked"] * 8,
            "deny": ["denied"] * 8,
            "local": ["5"] * 5 + ["limited"] * 3,  # 1/gateways of rpm 10, this gateway's own
        }[on_error]
    )
    redis_server.start()
    deadline = time.monotonic() + 5
    while not limiter.shared.up and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert metric(limiter, "rate_limit_store_up") == 1
    # The shared bucket again (a fresh Redis: full), through connections that the restart
    # closed: each is opened again without a fallback.
    grants = []
    for _ in range(4):
        grants.append(asyncio.ensure_future(limiter.admit(None, "m1", 0)))
        await asyncio.sleep(0)  # each in a batch of its own, in flight together
    remaining = {g.headers["x-ratelimit-remaining-requests"] for g in await asyncio.gather(*grants)}
    assert remaining == {"9", "8", "7", "6"}
    assert db.exists(PREFIX + "model:m1:requests")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "does not answer" in lines[0] and f"on_error {on_error}" in lines[0]
    assert "answers again" in lines[1]


async def test_a_stalled_redis_times_out_to_the_policy(limiters, redis_server):
    limiter = await limiters("allow", rpm=10)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for _ in range(5):
            assert await limiter.admit(None, "m1", 0) is NO_LIMITS
        assert time.monotonic() - started < 1.0  # one timeout (200 ms), not five
        assert metric(limiter, "rate_limit_store_errors", "timeout") == 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while not limiter.shared.up and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert "x-ratelimit-limit-requests" in (await limiter.admit(None, "m1", 0)).headers


async def test_redis_down_at_start_is_found_at_once(redis_server, caplog):
    caplog.set_level(logging.WARNING, "modelyard.gateway")
    redis_server.kill()
    fleet = config(redis_server.url, "deny", rpm=10)
    limiter = RateLimiter(SharedLimits(fleet.gateway.state, GatewayMetrics()))
    limiter.configure(fleet)
    await limiter.start()
    try:
        assert metric(limiter, "rate_limit_store_up") == 0
        assert (
            caplog.records[0]
            .getMessage()
            .startswith(
                f"rate limits: Redis at redis://127.0.0.1:{redis_server.port}/0 does not answer"
            )
        )
        with pytest.raises(RequestRefused):
            await limiter.admit(None, "m1", 0)
    finally:
        await limiter.close()
