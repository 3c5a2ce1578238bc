"""A non-streaming attempt: the whole answer is read before anything reaches the client, so any
failure up to its last byte can still be retried elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace

import aiohttp
from aiohttp import web

from gateway.backend import Backend
from gateway.proxy import failures
from gateway.proxy.exchange import Exchange
from gateway.proxy.failures import JSON
from gateway.proxy.model_names import rename_for, rename_model
from gateway.proxy.upstream import Answer, Upstream

_DECODER = json.JSONDecoder()


async def fetch(upstream: Upstream, ex: Exchange, backend: Backend) -> Answer:
    """One attempt: ``first_byte_s`` to the response headers, then ``idle_s`` for the body, all
    within ``total_s``."""
    timeouts = ex.route.config.timeouts
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = ex.deadline(start)
    phase = "first_byte"
    backend.outstanding += 1
    try:
        async with asyncio.timeout_at(min(deadline, start + timeouts.first_byte_s)) as cm:
            resp = await upstream.send(ex, backend)
            try:
                upstream.observe_latency(ex, backend, loop.time() - start)
                phase = "idle"
                cm.reschedule(min(deadline, loop.time() + timeouts.idle_s))
                body = await resp.read()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                resp.close()
                failure = failures.disconnected("The upstream closed the connection mid-response.")
                raise upstream.connection_failed(ex, backend, failure) from exc
            finally:
                resp.release()
    except TimeoutError as exc:
        if isinstance(exc, aiohttp.ClientError):
            raise
        raise upstream.timed_out(ex, backend, phase, loop.time() >= deadline) from exc
    finally:
        backend.outstanding -= 1
    answer = Answer.of(resp, body)
    upstream.judge(ex, backend, answer)
    if answer.status == 200 and answer.content_type == JSON:
        _read_usage(ex, body)
    return answer


def respond(ex: Exchange, answer: Answer) -> web.Response:
    """The client's copy of the answer, a success under the served model name."""
    rename = rename_for(ex.route.config) if answer.status == 200 else None
    if rename:
        answer = replace(answer, body=rename_model(answer.body, rename))
    return answer.response(ex)


def _read_usage(ex: Exchange, body: bytes) -> None:
    """Decodes just the ``usage`` object (usually at the end) rather than the whole answer."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        colon = body.index(b":", at + 7)
        usage, _ = _DECODER.raw_decode(body[colon + 1 :].decode().lstrip())
        ex.usage(usage)
