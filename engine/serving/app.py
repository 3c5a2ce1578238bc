"""The engine's OpenAI-compatible HTTP API (aiohttp): one process, one model, several names."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from common.errors import RequestRefused, error_object, error_response, excerpt, refusal_response
from common.http_server import ClientLimits
from common.json_body import parse_json_body
from common.request_body import read_body
from engine.errors import EngineError, InvalidRequestError
from engine.serving import requests
from engine.serving.async_engine import AsyncEngine
from engine.serving.errors import ModelNotFoundError
from engine.serving.metrics import CONTENT_TYPE
from engine.serving.request_fields import get_token_ids
from engine.serving.responses import ResponseBuilder, new_request_id
from engine.serving.status import status_body
from engine.serving.structured_fields import structured_param

log = logging.getLogger("engine.server")

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
SETTINGS_KEY = web.AppKey("settings", "ServerSettings")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    max_body_bytes: int = 4 * 2**20
    # Request line and each header field; aiohttp's default, ample for an API (the gateway
    # forwards only a few short headers). Longer gets a JSON 431 from EngineRunner.
    max_header_bytes: int = 8190
    client_limits: ClientLimits = field(default_factory=ClientLimits)
    created: int = field(default_factory=lambda: int(time.time()))


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error object, whatever raised it."""
    try:
        return await handler(request)
    except EngineError as error:
        return error_response(
            error.status, error.message, error.code, error.param, error.headers, error.error_type
        )
    except RequestRefused as refused:  # the shared HTTP layer's: body size, encoding, JSON
        return refusal_response(refused)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_response(error.status, f"{error.reason}: {request.method} {request.path}")
    except Exception:  # a bug, not bad input: still answer in OpenAI's shape, and log it
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal server error", code="internal_error")


def _engine(request: web.Request) -> AsyncEngine:
    return request.app[ENGINE_KEY]


async def _read_json(request: web.Request) -> Any:
    settings = request.app[SETTINGS_KEY]
    body = await read_body(request, settings.max_body_bytes, settings.client_limits.body_timeout_s)
    return await parse_json_body(body)


def _served_name(request: web.Request, body: Any) -> str:
    """The requested model name (default: the first served name); 404 for any other."""
    names = request.app[SETTINGS_KEY].served_model_names
    model = body.get("model") if isinstance(body, dict) else None
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must be a string", param="model")
    if model not in names:
        raise ModelNotFoundError(
            f"The model {excerpt(repr(model))} does not exist.",
            param="model",
            code="model_not_found",
        )
    return model


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


# ---- generation ----------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, requests.parse_chat_request)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, requests.parse_completion_request)


async def _generate(request: web.Request, parse: Any) -> web.StreamResponse:
    engine = _engine(request)
    body = await _read_json(request)
    model = _served_name(request, body)
    engine.check_accepting()  # before any parsing work
    limits = engine.limits
    parsed: requests.GenerationRequest = parse(body, limits)  # the cheap checks, n's bound too
    # The constraint compiles (in a worker process) while the prompt is templated and tokenised;
    # a bad one is a 400 before any streaming. The ticket holds its grammar until the reply
    # ends; a client that leaves releases it, which cancels a compile nobody else waits for.
    constraint, param = parsed.params.structured, structured_param(body)
    ticket = None
    try:
        with engine.preparing(parsed.params.n):  # its places in the queue bound, from here on
            if constraint is not None:
                ticket = engine.request_grammar(constraint, param)
            parsed.prompt_token_ids = await engine.on_prompt_thread(
                lambda tokenizer: requests.encode_prompt(parsed, tokenizer, limits)
            )
            if ticket is not None:
                await engine.wait_grammar(ticket, param)
        request_id = new_request_id(parsed.kind)
        builder = ResponseBuilder(parsed, request_id, model, engine.tokenizer)
        # Leaving the context early (client disconnect cancels this handler) aborts the request.
        async with engine.generate(request_id, parsed.prompt_token_ids, parsed.params) as outputs:
            if not parsed.stream:
                async for out in outputs:
                    builder.add(out)
                return web.json_response(builder.response(), dumps=_dumps)
            return await _stream(request, builder, outputs)
    finally:
        if ticket is not None:
            ticket.release()


async def _stream(
    request: web.Request, builder: ResponseBuilder, outputs: Any
) -> web.StreamResponse:
    """Server-sent events: OpenAI chunks as they come, the usage chunk if asked, then [DONE]."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        for chunk in builder.first_chunks():
            await response.write(_sse(chunk))
        try:
            async for out in outputs:
                data = b"".join(_sse(chunk) for chunk in builder.chunks(out))
                if data:
                    await response.write(data)
        except EngineError as error:  # headers are out: report in-band, like OpenAI does
            body = error_object(
                error.status, error.message, error.code, error.param, error.error_type
            )
            await response.write(_sse(body))
        if builder.request.include_usage:
            await response.write(_sse(builder.usage_chunk()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; leaving generate() unfinished aborts the request.
        log.debug("client disconnected from %s", builder.request_id)
    return response


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False)


# ---- small endpoints -----------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    engine = _engine(request)
    data = [
        {
            "id": name,
            "object": "model",
            "created": settings.created,
            "owned_by": "modelyard",
            "root": settings.served_model_names[0],
            "max_model_len": engine.max_model_len or None,
        }
        for name in settings.served_model_names
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    if not _engine(request).is_alive:
        return error_response(503, "engine loop is not running", code="engine_dead")
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    engine = _engine(request)
    if engine.is_ready:
        return web.json_response({"status": "ready"})
    if not engine.is_alive:
        reason, code = "engine loop is not running", "engine_dead"
    elif engine.core is None:
        reason, code = "model is still loading", "not_ready"
    elif engine.sleeping:
        reason, code = "engine is sleeping", "engine_sleeping"
    else:
        reason, code = "server is shutting down", "shutting_down"
    return error_response(503, reason, code=code)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=_engine(request).metrics.render(), headers={"Content-Type": CONTENT_TYPE}
    )


async def _tokenizer_body(request: web.Request) -> tuple[AsyncEngine, dict[str, Any]]:
    """Engine and body of a /tokenize or /detokenize call, checked in order: valid JSON, a served
    model name, the model loaded, a JSON object."""
    engine = _engine(request)
    body = await _read_json(request)
    _served_name(request, body)
    engine.check_loaded()
    engine.check_awake()
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return engine, body


async def tokenize(request: web.Request) -> web.Response:
    engine, body = await _tokenizer_body(request)
    with engine.preparing(1):
        tokens = await engine.on_prompt_thread(requests.parse_tokenize_request(body, engine.limits))
    return web.json_response(
        {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    )


async def detokenize(request: web.Request) -> web.Response:
    engine, body = await _tokenizer_body(request)
    tokens = get_token_ids(body, "tokens", len(engine.tokenizer))
    with engine.preparing(1):
        text = await engine.on_prompt_thread(lambda tokenizer: tokenizer.decode(tokens))
    return web.json_response({"prompt": text}, dumps=_dumps)


# ---- sleep and wake (vLLM's endpoint names) ------------------------------------------------

SLEEP_LEVELS = ("1",)  # 1: weights out of process memory, KV cache freed


async def sleep(request: web.Request) -> web.Response:
    level = request.query.get("level", "1")
    if level not in SLEEP_LEVELS:
        raise InvalidRequestError(
            f"sleep level {excerpt(repr(level))} is not supported: the only level is 1",
            param="level",
        )
    await _engine(request).sleep()
    return web.json_response({"is_sleeping": True})


async def wake_up(request: web.Request) -> web.Response:
    await _engine(request).wake_up()
    return web.json_response({"is_sleeping": False})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": _engine(request).sleeping})


async def status(request: web.Request) -> web.Response:
    engine = _engine(request)
    model = request.app[SETTINGS_KEY].served_model_names[0]
    return web.json_response(
        status_body(model, engine.sleeping, engine.footprint, engine.grammar_stats())
    )


# ---- app -----------------------------------------------------------------------------------


def create_app(engine: AsyncEngine, settings: ServerSettings) -> web.Application:
    """The aiohttp app; the caller starts ``engine`` (engine.serving.server.serve does) and owns its
    lifetime."""
    # _read_json enforces the body limit (after decompression, unlike aiohttp's own).
    app = web.Application(
        middlewares=[openai_errors],
        handler_args={
            "max_line_size": settings.max_header_bytes,
            "max_field_size": settings.max_header_bytes,
        },
    )
    app[ENGINE_KEY] = engine
    app[SETTINGS_KEY] = settings
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/status", status)

    async def stop_accepting(_: web.Application) -> None:
        engine.accepting = False  # draining: in-flight requests finish, new ones get a 503

    async def stop_engine(_: web.Application) -> None:
        await engine.shutdown()

    app.on_shutdown.append(stop_accepting)
    app.on_cleanup.append(stop_engine)
    return app
