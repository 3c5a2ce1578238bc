"""Gateway test fixtures: mock upstream processes (scripts/mock_upstream.py) and an in-process
gateway on free ports."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from common.net import free_port
from gateway.admission import Seat
from gateway.admission.control import ANONYMOUS
from gateway.admission.line import ModelLine, no_load, nothing_coming
from gateway.app import Gateway, create_app
from gateway.config import load_config, parse_config
from gateway.engines import pool as gateway_pool
from gateway.metrics import GatewayMetrics
from gateway.router import ModelRoute, Router
from gateway.server import GatewayRunner
from scripts.mock_upstream import MockUpstream
from tests.gateway.serve_process import with_engine_logs

FAKE_ENGINE = (sys.executable, str(Path(__file__).with_name("fake_engine.py")))
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def upstreams() -> Iterator[list[MockUpstream]]:
    """Two long-lived mock upstreams shared by tests that do not kill them."""
    mocks = [MockUpstream("mock-a").start(), MockUpstream("mock-b").start()]
    yield mocks
    for mock in mocks:
        mock.stop()


@pytest.fixture
def fresh_upstreams(upstreams: list[MockUpstream]) -> list[MockUpstream]:
    for mock in upstreams:
        mock.control()
    return upstreams


@pytest.fixture
def spawn_upstream() -> Iterator:
    """Starts mock upstreams a test may kill; all are stopped afterwards."""
    started: list[MockUpstream] = []

    def spawn(name: str = "mock-model", port: int | None = None) -> MockUpstream:
        mock = MockUpstream(name, port).start()
        started.append(mock)
        return mock

    yield spawn
    for mock in started:
        mock.stop()


def fleet(upstream_urls: list[str], **gateway: Any) -> dict[str, Any]:
    """A models.yaml document with one routed model 'm1' (alias 'default') and fast health
    settings; keyword arguments override gateway settings."""
    # timeout_s 2: the mocks answer at once, but on a busy 2-core machine a probe can take over
    # 0.5 s, and with unhealthy_after 1 that one probe took a replica out of a routing test
    settings: dict[str, Any] = {
        "health": {"interval_s": 0.2, "timeout_s": 2.0, "unhealthy_after": 1, "healthy_after": 1},
        "ejection": {"consecutive_failures": 2, "base_s": 0.3, "max_s": 5, "max_percent": 50},
        "retries": {"attempts": 3, "backoff_ms": 5},
        "watch_config": False,
    }
    settings.update(gateway)
    return {
        "gateway": settings,
        "models": [
            {
                "name": "m1",
                "aliases": ["default"],
                "upstreams": upstream_urls,
                "health_path": "/ready",
            }
        ],
    }


def model_route(**model: Any) -> ModelRoute:
    """The route of one external model 'm' (keyword arguments: more of its models.yaml keys)."""
    config = parse_config({"models": [{"name": "m", "upstreams": ["http://127.0.0.1:9"], **model}]})
    router = Router()
    router.apply(config)
    route = router.resolve("m")
    assert route is not None
    return route


def seat(route: ModelRoute) -> Seat:
    """A seat in a line of ``route``'s own, for an Exchange built by hand."""
    return Seat(ModelLine(route, GatewayMetrics(), nothing_coming, no_load), ANONYMOUS, 0)


class RunningGateway:
    def __init__(
        self, gateway: Gateway, url: str, session: aiohttp.ClientSession, path: Path
    ) -> None:
        self.gateway = gateway
        self.url = url
        self.http = session
        self.path = path

    async def post(self, path: str, body: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        return await self.http.post(self.url + path, json=body, **kwargs)

    async def chat(self, model: str = "m1", **fields: Any) -> aiohttp.ClientResponse:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
        return await self.post("/v1/chat/completions", body)


@pytest.fixture
async def start_gateway(tmp_path: Path) -> AsyncIterator:
    """Starts an in-process gateway from a models.yaml document written to tmp_path."""
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(
        document: dict[str, Any],
        env: dict[str, str] | None = None,
    ) -> RunningGateway:
        path = tmp_path / "models.yaml"
        path.write_text(yaml.safe_dump(with_engine_logs(document, tmp_path / "engines")))
        with _env(env or {}):
            config = load_config(path)
        gateway = Gateway(config, str(path))
        runner = GatewayRunner(create_app(gateway), handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        session = aiohttp.ClientSession()
        sessions.append(session)
        return RunningGateway(gateway, f"http://127.0.0.1:{port}", session, path)

    yield start
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
async def pooled(tmp_path, monkeypatch):
    """start(models.yaml document) → (gateway, url, path): a gateway whose engine pool spawns
    tests/gateway/fake_engine.py processes, with quick backoff and readiness polls."""
    monkeypatch.setattr(gateway_pool, "BACKOFF_BASE_S", 0.2)
    monkeypatch.setattr(gateway_pool, "READY_POLL_S", 0.05)
    runners = []

    async def start(doc: dict):
        path = tmp_path / "models.yaml"
        path.write_text(yaml.safe_dump(with_engine_logs(doc, tmp_path / "engines")))
        gateway = Gateway(load_config(path), str(path), engine_launcher=FAKE_ENGINE)
        runner = web.AppRunner(create_app(gateway), handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return gateway, f"http://127.0.0.1:{port}", path

    yield start
    for runner in runners:
        await runner.cleanup()
