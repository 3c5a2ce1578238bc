"""The ``make_target`` fixture: a gateway or an engine to attack, stopped after the test."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest

from common.http_server import ClientLimits
from tests.fake_core import FakeCore
from tests.gateway.client_hardening.targets import BODY_LIMIT, FAST, MakeTarget, Target
from tests.gateway.conftest import fleet
from tests.server_utils import InProcessServer


@pytest.fixture
async def make_target(start_gateway, fresh_upstreams, tokenizer) -> AsyncIterator[MakeTarget]:
    engines: list[InProcessServer] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(
        kind: str, limits: ClientLimits = FAST, max_body_bytes: int = BODY_LIMIT
    ) -> Target:
        if kind == "gateway":
            up = fresh_upstreams[0]
            document = fleet(
                [up.url], max_body_bytes=max_body_bytes, clients=dataclasses.asdict(limits)
            )
            gw = await start_gateway(document)
            valid = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
            return Target(kind, gw.url, gw.http, "/v1/chat/completions", valid, up)
        server = await InProcessServer(
            lambda: FakeCore(tokenizer, max_model_len=64),
            ["tiny"],
            max_body_bytes=max_body_bytes,
            client_limits=limits,
        ).start()
        engines.append(server)
        session = aiohttp.ClientSession()
        sessions.append(session)
        valid = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        return Target(kind, server.url, session, "/v1/completions", valid)

    yield make
    for session in sessions:
        await session.close()
    for server in engines:
        await server.stop()
