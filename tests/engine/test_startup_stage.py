"""The engine's start-up stage (engine/startup.py): the innermost phase running with its percent,
``loading`` between phases and ``ready`` once loaded; and ``GET /status`` answering it while the
model loads (the gateway's load progress reads it: gateway/engines/progress.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import aiohttp
import pytest

from engine import startup
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer


@pytest.fixture(autouse=True)
def fresh_start(monkeypatch):
    """This process's start-up record, as a new engine's."""
    monkeypatch.setattr(startup, "_phases", {})
    monkeypatch.setattr(startup, "_running", [])
    monkeypatch.setattr(startup, "_loaded", False)
    startup.mark_process_start(time.monotonic())


def test_the_stage_is_the_innermost_phase_with_its_percent():
    assert startup.stage()["stage"] == "loading"
    with startup.phase("narrow weights"):
        assert startup.stage()["stage"] == "narrow weights"
        with startup.phase("kernels"):
            startup.progress(3, 4)
            inner = startup.stage()
            assert (inner["stage"], inner["percent"]) == ("kernels", 75.0)
        outer = startup.stage()
        assert (outer["stage"], outer["percent"]) == ("narrow weights", None)
        startup.progress(9, 4)  # never past 100
        assert startup.stage()["percent"] == 100.0
    between = startup.stage()
    assert between["stage"] == "loading" and between["stage_s"] < 1.0
    assert list(startup.phases()) == ["kernels", "narrow weights"]
    startup.progress(1, 2)  # no phase runs: nothing to count
    assert startup.stage()["percent"] is None
    startup.mark_loaded()
    ready = startup.stage()
    assert ready["stage"] == "ready" and ready["since_start_s"] >= ready["stage_s"] >= 0


async def test_status_answers_the_stage_while_the_model_loads(tokenizer):
    gate = threading.Event()

    def slow_core() -> FakeCore:
        with startup.phase("weights"):
            startup.progress(1, 4)
            gate.wait(10)
        return FakeCore(tokenizer)

    srv = await InProcessServer(slow_core, ["tiny"]).start(wait_loaded=False)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(srv.url + "/status") as reply:
                assert reply.status == 200
                loading = (await reply.json())["startup"]
            assert (loading["stage"], loading["percent"]) == ("weights", 25.0)
            async with session.get(srv.url + "/ready") as reply:
                assert reply.status == 503
    finally:
        gate.set()
        await srv.stop()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_paused_while_loading_then_what_lives_is_frozen():
    """No cyclic collection runs during the load; garbage the load left is collected after it,
    and what it built is kept out of every later pass."""
    assert gc.isenabled()
    try:
        with startup.collector_paused():
            assert not gc.isenabled()
            garbage = _Cycle()
            collected = weakref.ref(garbage)
            del garbage
            assert collected() is not None  # only a collection frees a cycle
            kept = _Cycle()
        assert gc.isenabled() and collected() is None
        assert "garbage collection" in startup.phases()
        assert gc.is_tracked(kept) and not any(o is kept for o in gc.get_objects())  # frozen
    finally:
        gc.unfreeze()
