"""The servers under attack (``Target``: the gateway on a mock upstream or the engine on a fake
core, with a request each must keep answering), their fast client deadlines and body limit, and
the OpenAI error check every attack's answer gets."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from common.http_server import ClientLimits
from scripts.mock_upstream import MockUpstream

FAST = ClientLimits(
    header_timeout_s=0.6,
    body_timeout_s=0.6,
    idle_timeout_s=0.6,
    max_connections=64,
    max_connections_per_address=64,
)
BODY_LIMIT = 64 * 1024


@dataclass
class Target:
    """One server under attack and a request it must keep answering with 200."""

    kind: str
    url: str
    http: aiohttp.ClientSession
    path: str
    valid: dict[str, Any]
    upstream: MockUpstream | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    async def post(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        async with self.http.post(
            self.url + self.path,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as reply:
            return reply.status, json.loads(await reply.read())

    async def assert_still_serving(self) -> None:
        status, payload = await self.post(json.dumps(self.valid).encode())
        assert status == 200, payload


MakeTarget = Callable[..., Awaitable[Target]]
both = pytest.mark.parametrize("kind", ["gateway", "engine"])


def openai_error(payload: dict, code: str) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    return error
