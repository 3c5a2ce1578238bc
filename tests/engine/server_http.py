"""HTTP helpers of the engine server tests: JSON requests, a stream's SSE events, /metrics
samples and chat bodies for the tiny model."""

from __future__ import annotations

import json

import aiohttp

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
        return reply.status, await reply.json()


async def stream(url: str, body: dict) -> list[dict | str]:
    """All SSE events of one streaming request, JSON-decoded except the final "[DONE]"."""
    events: list[dict | str] = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
        assert reply.status == 200, await reply.text()
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        async for line in reply.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            data = line[len(b"data: ") :].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
        text = await reply.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def chat_body(content: str, **extra: object) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }
