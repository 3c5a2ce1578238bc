"""A streaming attempt: it succeeds with the upstream's first chunk, and only then do the client's
response headers go out; after that the events are relayed as they arrive, and a failure can only
end the stream with an SSE error event."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.backend import Backend
from gateway.proxy import failures
from gateway.proxy.exchange import Exchange
from gateway.proxy.model_names import rename_for
from gateway.proxy.quarantine import Quarantine
from gateway.proxy.sse import SseRelay, sse_error_event
from gateway.proxy.upstream import Answer, Upstream

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(slots=True)
class OpenedStream:
    """An upstream stream that has sent its first chunk."""

    resp: aiohttp.ClientResponse
    first: bytes
    backend: Backend


async def open_stream(upstream: Upstream, ex: Exchange, backend: Backend) -> OpenedStream:
    """Sends the request and waits for the first chunk; only then is the attempt a success."""
    timeouts = ex.route.config.timeouts
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = ex.deadline(start)
    backend.outstanding += 1
    resp: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout_at(min(deadline, start + timeouts.first_byte_s)):
            resp = await upstream.send(ex, backend)
            upstream.observe_latency(ex, backend, loop.time() - start)
            if resp.status != 200:
                body = await resp.read()
                resp.release()
                answer = Answer.of(resp, body)
                upstream.judge(ex, backend, answer)
                raise answer.failure()
            first = await resp.content.readany()
    except TimeoutError as exc:
        if resp is not None:
            resp.close()
        backend.outstanding -= 1
        if isinstance(exc, aiohttp.ClientError):
            raise
        raise upstream.timed_out(ex, backend, "first_byte", loop.time() >= deadline) from exc
    except aiohttp.ClientError as exc:
        if resp is not None:
            resp.close()
        backend.outstanding -= 1
        failure = failures.disconnected("The upstream closed the connection before streaming.")
        raise upstream.connection_failed(ex, backend, failure) from exc
    except BaseException:
        if resp is not None:
            resp.close()
        backend.outstanding -= 1
        raise
    if not first:
        resp.close()
        backend.outstanding -= 1
        failure = failures.disconnected("The upstream ended the stream before any data.")
        raise upstream.connection_failed(ex, backend, failure)
    upstream.succeeded(backend)
    ex.backend = backend.label
    return OpenedStream(resp, first, backend)


async def relay(
    upstream: Upstream,
    quarantine: Quarantine,
    request: web.Request,
    ex: Exchange,
    opened: OpenedStream,
) -> web.StreamResponse:
    """Relays SSE events as they arrive; ends with an error event if the upstream fails (its
    engine's crash judged by the quarantine)."""
    resp, backend = opened.resp, opened.backend
    timeouts = ex.route.config.timeouts
    loop = asyncio.get_running_loop()
    deadline = ex.deadline(loop.time())
    response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **ex.response_headers()})
    events = SseRelay(ex, ex.strip_usage, rename_for(ex.route.config))
    ex.status = 200
    phase = "write"
    try:
        async with asyncio.timeout_at(deadline) as cm:
            await response.prepare(request)
            metrics = upstream.metrics
            metrics.child(metrics.ttft, ex.route.name).observe(time.monotonic() - ex.started)
            chunk = opened.first
            while chunk:
                out = events.feed(chunk)
                if out:
                    phase = "write"
                    cm.reschedule(deadline)
                    await response.write(out)
                phase = "idle"
                cm.reschedule(min(deadline, loop.time() + timeouts.idle_s))
                chunk = await resp.content.readany()
            phase = "write"
            cm.reschedule(deadline)
            tail = events.flush()
            if tail:
                await response.write(tail)
            if not events.done:
                upstream.failed(ex, backend)
                ex.error = "stream_cut"
                await response.write(
                    sse_error_event(
                        502,
                        "The upstream ended the stream without finishing it.",
                        "upstream_stream_cut",
                    )
                )
    except TimeoutError as exc:
        if isinstance(exc, aiohttp.ClientError) or phase == "write":
            ex.status, ex.error = 499, "client_too_slow"  # the client stopped reading
        else:
            failure = upstream.timed_out(ex, backend, phase, loop.time() >= deadline)
            ex.error = failure.reason
            await _try_write(
                response, sse_error_event(504, str(failure), f"upstream_{failure.reason}")
            )
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionResetError):
        if phase == "write":
            ex.status, ex.error = 499, "client_disconnected"
        else:
            upstream.failed(ex, backend)
            crashed = await quarantine.judge(ex, backend)
            if crashed is None:
                ex.error = "upstream_disconnected"
                event = sse_error_event(
                    502, "The upstream failed in the middle of the stream.", ex.error
                )
            else:
                ex.error = crashed.reason
                event = sse_error_event(crashed.status, str(crashed), crashed.reason)
            await _try_write(response, event)
    finally:
        backend.outstanding -= 1
        if events.done and not events.pending:
            resp.release()
        else:
            resp.close()  # drop the upstream connection: the upstream stops generating
    return response


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    """Best effort: the error event cannot reach a client that has gone."""
    try:
        if response.prepared:
            await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass
