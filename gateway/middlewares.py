"""Request middlewares: request id + error shape + access log + request metrics (``context``),
then ``auth``. Every refusal raised below them (``RequestRefused``) becomes its OpenAI error
answer in ``context``."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from common.errors import RequestRefused, error_response, refusal_response
from gateway.metrics import UNKNOWN_MODEL
from gateway.openai_api import CHAT_PATH, COMPLETIONS_PATH
from gateway.request_keys import API_KEY, EXCHANGE, MODEL, REQUEST_ID
from gateway.state import GATEWAY_KEY, Gateway

log = logging.getLogger("modelyard.gateway")

_QUIET_PATHS = frozenset(("/health", "/ready", "/metrics"))
_COMPLETION_PATHS = frozenset((CHAT_PATH, COMPLETIONS_PATH))
_MAX_REQUEST_ID = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return os.urandom(12).hex()


@web.middleware
async def context(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = _request_id(request)
    request[REQUEST_ID] = request_id
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
    except RequestRefused as exc:  # the gateway's own, and the shared HTTP layer's
        response = refusal_response(exc)
        status = exc.status
    except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method...
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason, code="http_error")
        status = exc.status
    except asyncio.CancelledError:
        status = 499  # the client went away; the handler's cleanup closed the upstream
        raise
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, request.path, request_id
        )
        response = error_response(500, "Internal gateway error.", code="internal_error")
    finally:
        _finish(request.app[GATEWAY_KEY], request, request_id, started, status)
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    return response


def _finish(
    gateway: Gateway, request: web.Request, request_id: str, started: float, status: int
) -> None:
    path = request.path
    if path in _QUIET_PATHS:
        return
    elapsed = time.monotonic() - started
    ex = request.get(EXCHANGE)
    if ex is not None and ex.status:
        status = ex.status  # a started stream may have ended badly after its 200
    if path in _COMPLETION_PATHS:
        model = request.get(MODEL, UNKNOWN_MODEL)
        metrics = gateway.metrics
        metrics.child(metrics.requests, model, str(status)).inc()
        metrics.child(metrics.request_duration, model).observe(elapsed)
    if not gateway.config.gateway.access_log:
        return
    key = request.get(API_KEY)
    entry = {
        "ts": round(time.time(), 3),
        "request_id": request_id,
        "method": request.method,
        "path": path,
        "status": status,
        "latency_ms": round(elapsed * 1000, 2),
        "model": request.get(MODEL),
        "key": key.name if key else None,
    }
    if ex is not None:
        entry.update(
            backend=ex.backend,
            stream=ex.stream,
            retries=ex.retries,
            prompt_tokens=ex.prompt_tokens,
            completion_tokens=ex.completion_tokens,
            error=ex.error,
            queue_wait_ms=round(ex.seat.wait_s * 1000, 2),
            queue_position=ex.seat.position,
        )
    gateway.access_log.write(entry)


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    path = request.path
    if path.startswith("/v1/"):
        authenticator = request.app[GATEWAY_KEY].auth
        request[API_KEY] = authenticator.client(request.headers.get("Authorization"))
    elif path.startswith("/admin"):
        request.app[GATEWAY_KEY].auth.admin(request.headers.get("Authorization"))
    return await handler(request)
