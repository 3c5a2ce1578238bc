"""The OpenAI-compatible endpoints: parse and check the request, route, rate-limit, wait in the
model's line (gateway/admission), proxy."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from common.errors import RequestRefused, excerpt
from common.json_body import parse_json_body
from common.request_body import read_body
from gateway.auth import may_use
from gateway.capabilities import check_capabilities
from gateway.limits import RateLimited
from gateway.proxy import Exchange
from gateway.request_keys import API_KEY, EXCHANGE, MODEL, REQUEST_ID
from gateway.router import ModelRoute
from gateway.state import GATEWAY_KEY

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


async def parse_request(body: bytes, chat: bool) -> dict[str, Any]:
    """Checks the fields the gateway relies on; the upstream validates the rest."""
    payload = await parse_json_body(body)
    if not isinstance(payload, dict):
        raise RequestRefused(400, "Request body must be a JSON object.", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRefused(
            400,
            "'model' is required and must be a non-empty string.",
            param="model",
            code="invalid_value",
        )
    if chat:
        messages = payload.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise RequestRefused(
                400,
                "'messages' must be a non-empty list of objects.",
                param="messages",
                code="invalid_value",
            )
    elif not isinstance(payload.get("prompt"), (str, list)):
        raise RequestRefused(
            400,
            "'prompt' is required and must be a string or a list.",
            param="prompt",
            code="invalid_value",
        )
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestRefused(
            400, "'stream' must be a boolean.", param="stream", code="invalid_value"
        )
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestRefused(
            400, "'stream_options' must be an object.", param="stream_options", code="invalid_value"
        )
    return payload


def prompt_text(payload: dict[str, Any], limit: int) -> str:
    """The prompt's text (chat message contents in order), up to ``limit`` characters."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list):
        return "".join(p for p in prompt if isinstance(p, str))[:limit]
    parts: list[str] = []
    size = 0
    for message in payload.get("messages") or ():
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if isinstance(content, str):
            parts.append(content)
            size += len(content)
            if size >= limit:
                break
    return "".join(parts)[:limit]


def estimate_prompt_tokens(payload: dict[str, Any]) -> int:
    """About four characters per token, plus a few per chat message; token-id prompts count
    exactly. Corrected from the upstream's usage once the answer is in (rate limits, fair
    shares)."""
    tokens = 0
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    tokens += 4 * len(payload.get("messages") or ())
    return tokens + len(prompt_text(payload, 1 << 30)) // 4 + 1


def affinity_key(route: ModelRoute, payload: dict[str, Any]) -> bytes | None:
    affinity = route.config.affinity
    if affinity.by == "user":
        user = payload.get("user")
        return user.encode() if isinstance(user, str) and user else None
    if affinity.by == "prefix":
        text = prompt_text(payload, affinity.prefix_chars)
        return text.encode() if text else None
    return None


def upstream_body(
    body: bytes, payload: dict[str, Any], route: ModelRoute, stream: bool
) -> tuple[bytes, bool]:
    """The bytes to send upstream, re-encoded only when a field must change; and whether the
    usage event the gateway asked for must be stripped from the stream."""
    changed = False
    strip_usage = False
    if payload["model"] != route.config.wire_name:
        payload["model"] = route.config.wire_name
        changed = True
    if stream:
        options = payload.get("stream_options") or {}
        if not options.get("include_usage"):
            payload["stream_options"] = {**options, "include_usage": True}
            strip_usage = changed = True
    if changed:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return body, strip_usage


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, CHAT_PATH, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, COMPLETIONS_PATH, chat=False)


async def _completion(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    started = time.monotonic()
    settings = gw.config.gateway
    body = await read_body(request, settings.max_body_bytes, settings.clients.body_timeout_s)
    payload = await parse_request(body, chat)
    key = request[API_KEY]
    route = gw.router.resolve(payload["model"])
    if route is None or not may_use(key, route.name):
        raise RequestRefused(
            404,
            f"The model '{excerpt(payload['model'])}' does not exist or you do not have "
            "access to it.",
            param="model",
            code="model_not_found",
        )
    request[MODEL] = route.name
    check_capabilities(payload, route.config.capabilities, route.name)  # before any limit counts it
    key_name = key.name if key else None
    estimate = estimate_prompt_tokens(payload)
    try:
        grant = await gw.limiter.admit(key_name, route.name, estimate)
    except RateLimited as limited:
        gw.metrics.rate_limited.labels(route.name, limited.limit).inc()
        raise RequestRefused(
            429,
            f"Rate limit reached ({limited.limit.replace('_', ' ')}); retry in "
            f"{limited.retry_after_s:.2f}s.",
            code="rate_limit_exceeded",
            headers=limited.headers,
        ) from None
    seat = gw.admission.seat(route, key, estimate)
    stream = payload.get("stream") is True
    forward_body, strip_usage = upstream_body(body, payload, route, stream)
    ex = Exchange(
        request_id=request[REQUEST_ID],
        path=path,
        body=forward_body,
        stream=stream,
        strip_usage=strip_usage,
        route=route,
        grant=grant,
        seat=seat,
        affinity_key=affinity_key(route, payload),
        client=key_name or request.remote or "",
        started=started,
    )
    request[EXCHANGE] = ex
    gw.residency.touch(route.name)
    try:
        await seat.take()
        route.inflight += 1
        in_flight = gw.metrics.child(gw.metrics.in_flight, route.name)
        in_flight.inc()
        try:
            return await gw.proxy.forward(request, ex)
        finally:
            route.inflight -= 1
            in_flight.dec()
    except RequestRefused as refused:  # by the line, before or after an attempt
        ex.error = refused.code
        raise
    finally:
        seat.finish(ex.prompt_tokens, ex.completion_tokens)  # the slot, whatever happened
        gw.residency.touch(route.name)  # the idle TTL counts from the last request's end
        if ex.prompt_tokens is not None and ex.completion_tokens is not None:
            metrics = gw.metrics
            metrics.child(metrics.prompt_tokens, route.name).inc(ex.prompt_tokens)
            metrics.child(metrics.completion_tokens, route.name).inc(ex.completion_tokens)
            gw.token_rates.add(route.name, ex.completion_tokens)
            grant.settle(ex.prompt_tokens + ex.completion_tokens)


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    key = request[API_KEY]
    data = []
    residency = gw.residency
    for route in gw.router.routes.values():
        if not may_use(key, route.name):
            continue
        if route.name in residency.models:
            state = residency.model_state(route.name)
        else:
            state = "ready" if any(b.available for b in route.backends) else "unavailable"
        for served in (route.name, *route.config.aliases):
            data.append(
                {
                    "id": served,
                    "object": "model",
                    "created": gw.started_at,
                    "owned_by": "modelyard",
                    "root": route.name,
                    # not OpenAI's: ready, parked, stopped (loads at the first request), ...
                    "state": state,
                }
            )
    return web.json_response({"object": "list", "data": data})
