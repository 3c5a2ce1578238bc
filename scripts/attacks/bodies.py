"""Attacks by body (1, 4, 6): compression bombs, 4 MB prompts and small poison bodies, to the
gateway and to the engine directly."""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from scripts.attacks.context import Ctx
from scripts.attacks.fleet import MODEL
from scripts.attacks.raw_http import CHAT, answer_figures, http_request

ROLE_LIST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": ["user"], "content": "hi"}], "max_tokens": 4}
).encode()


def compressed(size: int, wbits: int) -> bytes:
    """``size`` bytes of spaces, compressed in 1 MiB steps (never whole in memory)."""
    step = b" " * (1 << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, wbits)
    parts = [comp.compress(step) for _ in range(size // len(step))]
    return b"".join(parts) + comp.flush()


def build_payloads() -> dict[str, bytes]:
    words = itertools.cycle(["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "elit"])
    prompt = " ".join(itertools.islice(words, 700_000))[:4_000_000]
    return {
        "deflate_bomb": compressed(1 << 30, 15),  # zlib stream: HTTP's "deflate"
        "gzip_spaces": compressed(256 << 20, 31),
        "big_chat": json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
        ).encode(),
        "big_completion": json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode(),
    }


def encoded_body(payload: str, encoding: str, target: str) -> Callable[[Ctx], Awaitable[dict]]:
    async def attack(ctx: Ctx) -> dict[str, Any]:
        base = ctx.fleet.url if target == "gateway" else ctx.fleet.engine_url
        body = ctx.payloads[payload]
        answer = await http_request(base, "POST", CHAT, body, {"Content-Encoding": encoding}, 60)
        return {"body_bytes": len(body), **answer.brief(), "figures": answer_figures(answer)}

    return attack


def big_prompt(payload: str, path: str, target: str) -> Callable[[Ctx], Awaitable[dict]]:
    async def attack(ctx: Ctx) -> dict[str, Any]:
        base = ctx.fleet.url if target == "gateway" else ctx.fleet.engine_url
        body = ctx.payloads[payload]
        answer = await http_request(base, "POST", path, body, timeout=60)
        return {"body_bytes": len(body), **answer.brief(), "figures": answer_figures(answer)}

    return attack


SMALL_BODIES: dict[str, tuple[bytes, dict[str, str]]] = {
    "lone_surrogate": (
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}],'
        b' "max_tokens": 4}',
        {},
    ),
    "nested_2000": (
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,'
        b' "x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        {},
    ),
    "invalid_gzip": (b"this is not gzip", {"Content-Encoding": "gzip"}),
    "role_list": (ROLE_LIST_BODY, {}),
}


async def small_bodies(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    for name, (body, headers) in SMALL_BODIES.items():
        for target, base in (("gateway", ctx.fleet.url), ("engine", ctx.fleet.engine_url)):
            answer = await http_request(base, "POST", CHAT, body, headers, timeout=30)
            out[f"{name}_{target}"] = answer.brief()
            figures[f"{name}_{target}"] = answer.text()
    return {**out, "figures": figures}
