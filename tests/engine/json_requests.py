"""What the engine's hostile-request tests share: JSON posted to an in-process server, the OpenAI
error it answers, and a check that a valid request is still served."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tests.server_utils import InProcessServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
VALID = {"prompt": "hello", "max_tokens": 2}


async def post(url: str, body: Any) -> tuple[int, dict, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=json.dumps(body), headers={"Content-Type": "application/json"}
        ) as reply,
    ):
        return reply.status, await reply.json(content_type=None), dict(reply.headers)


def openai_error(payload: dict, code: str | None = None, param: str | None = None) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def assert_still_serves(srv: InProcessServer) -> None:
    status, payload, _ = await post(srv.url + COMPLETIONS, VALID)
    assert status == 200, payload
