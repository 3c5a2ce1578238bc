"""A starting engine's load progress (gateway/engines/progress.py), with fake engines that report
a ``weights`` stage growing over their load: ``/admin/models`` shows it per replica while it
starts, the gateway logs a line per stage, and a held request that runs out of time is told which
stage the load is in; what an engine reports is read defensively."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp
import pytest

from common.errors import RequestRefused
from gateway.admission.control import ANONYMOUS
from gateway.admission.line import ModelLine, Seat
from gateway.backend import Condition
from gateway.engines.progress import BEFORE_LISTENING, reported_progress
from gateway.engines.replica import ReplicaState
from gateway.metrics import GatewayMetrics
from gateway.router import ModelRoute
from tests.gateway.conftest import model_route
from tests.gateway.test_residency import fleet, on_demand, request, states
from tests.gateway.test_resilience import wait_for

S = ReplicaState


async def test_a_starting_replica_shows_its_stage_and_a_timed_out_request_names_it(
    pooled, tmp_path, caplog
):
    caplog.set_level(logging.INFO, "modelyard.pool")
    model = on_demand(
        "od", "--ready-delay-s", "5", "--between-phases-s", "1.5", queue={"max_wait_s": 2}
    )
    gateway, url, _ = await pooled(fleet(tmp_path, [model]))
    async with aiohttp.ClientSession() as session:
        status, answer, _ = await request(session, url, "od")
        assert status == 503
        error = answer["body"]["error"]
        assert error["code"] == "model_loading_timeout"
        # its first phase until the engine answers (a busy machine), then the engine's own
        assert "replica 0 starting for" in error["message"]
        assert "in stage weights" in error["message"] or "in stage imports" in error["message"]

        async def progress() -> dict:
            async with session.get(url + "/admin/models") as resp:
                (replica,) = (await resp.json())["models"][0]["replicas"]
            return replica.get("progress") or {}

        deadline = time.monotonic() + 10
        while (seen := await progress()).get("stage") != "weights":
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.1)
        assert 0 < seen["percent"] < 100 and seen["stage_s"] >= 0
        while (seen := await progress()).get("stage") != "loading":  # between two phases
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.1)
        assert any(r.getMessage().startswith("replica od#0 loading: weights")
                   for r in caplog.records)  # fmt: skip

        await wait_for(lambda: states(gateway, "od") == [S.READY], timeout=15)
        assert await progress() == {}  # shown while it starts only
    stages = [r.getMessage() for r in caplog.records if " loading: " in r.getMessage()]
    assert len(stages) == 1  # weights: "loading" between phases (or "ready") is no stage


async def test_a_full_line_of_a_loading_model_says_where_the_load_stands():
    route = model_route(queue={"max_requests": 0})
    for backend in route.backends:  # no available backend: no slot, the model is loading
        backend.set_condition(Condition.UNHEALTHY)

    async def coming(route: ModelRoute, tried: object) -> bool:
        return True

    line = ModelLine(route, GatewayMetrics(), coming, lambda name: f"{name}: replica 0 waking")
    with pytest.raises(RequestRefused) as refused:
        await Seat(line, ANONYMOUS, 0).take()
    assert refused.value.code == "hold_queue_full"
    assert "m: replica 0 waking" in str(refused.value)


@pytest.mark.parametrize(
    "status",
    [None, {}, {"startup": "weights"}, {"startup": {"stage": 7}}, {"startup": {"percent": 5}}],
)
def test_an_engine_that_reports_no_stage_has_no_progress(status):
    assert reported_progress(status) is None


def test_what_an_engine_reports_is_bounded():
    odd = reported_progress({"startup": {"stage": "w" * 500, "percent": math.inf, "stage_s": -3}})
    assert odd is not None and len(odd.stage) == 100 and odd.percent is None
    assert odd.describe()["stage_s"] < 1.0
    good = reported_progress({"startup": {"stage": "weights", "percent": 45.5, "stage_s": 2}})
    assert good is not None and good.describe()["stage_s"] >= 2.0
    assert str(good).startswith("weights 46% (2.")
    assert BEFORE_LISTENING == "imports and http server"  # the engine's own first phase
