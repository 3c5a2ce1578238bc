"""Forwarding one request to a backend: timeouts, retries on another replica, SSE pass-through.

Retries (tenacity) happen only while nothing has been sent to the client: a unary answer is read in
full before it is sent, and a stream's response headers go out only once its first upstream chunk
has arrived. Retried: connect failures and timeouts, the upstream closing the connection before
answering, 502/503 answers, and the backend being ejected while the request waited on it; on a
different replica, with jittered exponential backoff, within a retry budget (about
``budget_percent`` of requests plus a small reserve per second). The first attempt runs outside
tenacity: its machinery costs about 40 µs per call, a tenth of the gateway's whole per-request CPU.

Timeouts: ``connect_s`` (TCP connect), ``first_byte_s`` (to the response headers; for streams to the
first chunk), ``idle_s`` (between chunks while reading), ``total_s`` (whole request). Each answers
504 before a stream started, or ends a started stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_random_exponential

from common.errors import error_body
from gateway.config import RetrySettings
from gateway.errors import sse_error_event
from gateway.health import HealthMonitor
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import Admission
from gateway.router import Backend, ModelRoute

_JSON = "application/json"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_RETRY_STATUSES = (502, 503)
# Answers that say the upstream (or a proxy before it) is unwell whatever was asked; the upstream's
# other 5xx may be its answer to a bad request.
_GATEWAY_STATUSES = (502, 503, 504)
# Answers whose back-off hints reach the client: an upstream that is rate limited or overloaded
# knows best when to come back.
_HINT_STATUSES = (429, 503)
_HINT_HEADERS = ("retry-after", "retry-after-ms")
_HINT_PREFIX = "x-ratelimit-"
_DECODER = json.JSONDecoder()


class RetryBudget:
    """Retries earn ``percent``% of a token per request, plus ``minimum`` tokens per second; a retry
    spends one. Bounded, so a long healthy spell cannot bank a retry storm."""

    def __init__(self, settings: RetrySettings) -> None:
        self.ratio = settings.budget_percent / 100
        self.per_second = float(settings.budget_min)
        self.cap = 2 * settings.budget_min + 100 * self.ratio
        self.balance = self.cap
        self.updated = time.monotonic()

    def deposit(self) -> None:
        self.balance = min(self.cap, self.balance + self.ratio)

    def try_spend(self) -> bool:
        now = time.monotonic()
        self.balance = min(self.cap, self.balance + (now - self.updated) * self.per_second)
        self.updated = now
        if self.balance >= 1:
            self.balance -= 1
            return True
        return False


def backoff_hints(status: int, headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream's ``Retry-After``/``retry-after-ms``/``x-ratelimit-*`` of a 429 or 503."""
    if status not in _HINT_STATUSES:
        return {}
    return {
        name: value
        for name, value in headers.items()
        if (lowered := name.lower()) in _HINT_HEADERS or lowered.startswith(_HINT_PREFIX)
    }


class UpstreamFailure(Exception):
    """How an attempt failed, already in the shape the client would get."""

    def __init__(
        self,
        status: int,
        body: bytes,
        reason: str,
        content_type: str = _JSON,
        message: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message or reason)
        self.status = status
        self.body = body
        self.reason = reason  # bounded: connect, connect_timeout, disconnect, status_502, ...
        self.content_type = content_type
        self.headers = headers or {}  # the upstream's back-off hints, passed to the client


class Retryable(UpstreamFailure):
    """A failure before anything reached the client, worth a try on another replica."""


@dataclass(slots=True, eq=False)
class Exchange:
    """One client request on its way through the proxy, and what the access log reports."""

    request_id: str
    path: str
    body: bytes
    stream: bool
    strip_usage: bool
    route: ModelRoute
    admission: Admission
    affinity_key: bytes | None = None
    client: str = ""  # who asked (API key name, else remote address): part of failure signatures
    started: float = field(default_factory=time.monotonic)
    backend: str = "-"
    status: int = 0
    retries: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    last_failure: UpstreamFailure | None = None
    task: asyncio.Task | None = None  # the handler's task, cancelled if its backend is ejected
    evicted_from: Backend | None = None

    def usage(self, usage: object) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.prompt_tokens, self.completion_tokens = prompt, completion


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        health: HealthMonitor,
        metrics: GatewayMetrics,
        retries: RetrySettings,
    ) -> None:
        self.session = session
        self.health = health
        self.metrics = metrics
        self.configure(retries)

    def configure(self, retries: RetrySettings) -> None:
        self.retries = retries
        self.budget = RetryBudget(retries)
        backoff_s = retries.backoff_ms / 1000
        self._wait = wait_random_exponential(multiplier=backoff_s, max=max(backoff_s * 8, 0.001))
        self._client_timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def forward(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        self.budget.deposit()
        ex.task = asyncio.current_task()
        try:
            if ex.stream:
                resp, first, backend = await self._with_retries(ex, self._open_stream)
                return await self._pump(request, ex, resp, first, backend)
            status, body, content_type, hints = await self._with_retries(ex, self._unary)
        except UpstreamFailure as failure:
            ex.status, ex.error = failure.status, failure.reason
            return web.Response(
                status=failure.status,
                body=failure.body,
                content_type=failure.content_type,
                headers=self._headers(ex, failure.headers),
            )
        ex.status = status
        if status == 200:
            body = self._rewrite_model(ex, body)
        return web.Response(
            status=status, body=body, content_type=content_type, headers=self._headers(ex, hints)
        )

    def _headers(self, ex: Exchange, hints: dict[str, str] | None = None) -> Mapping[str, str]:
        """The upstream's back-off hints replace the gateway's own rate-limit headers of the same
        name, whatever their case: the upstream's limit is the one that refused."""
        headers = {"x-request-id": ex.request_id, **ex.admission.headers}
        if not hints:
            return headers
        replaced = {name.lower() for name in hints}
        return {
            **{name: value for name, value in headers.items() if name.lower() not in replaced},
            **hints,
        }

    # ---- retries ----

    async def _with_retries(self, ex: Exchange, attempt_fn):
        tried: list[Backend] = []
        try:  # the common case, without the retry machinery's cost
            return await self._attempt(ex, attempt_fn, tried)
        except Retryable as failure:
            if self.retries.attempts < 2:
                raise
            replay: Retryable | None = failure

        def stop(state: RetryCallState) -> bool:
            return state.attempt_number >= self.retries.attempts or not self.budget.try_spend()

        def before_sleep(state: RetryCallState) -> None:
            ex.retries += 1
            failure = state.outcome.exception() if state.outcome else None
            reason = failure.reason if isinstance(failure, UpstreamFailure) else "unknown"
            self.metrics.retries.labels(ex.route.name, reason).inc()

        retrying = AsyncRetrying(
            stop=stop,
            wait=self._wait,
            reraise=True,
            retry=retry_if_exception_type(Retryable),
            before_sleep=before_sleep,
        )
        async for attempt in retrying:
            with attempt:
                if replay is not None:  # tenacity decides on the first attempt's failure too
                    failure, replay = replay, None
                    raise failure
                return await self._attempt(ex, attempt_fn, tried)
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def _attempt(self, ex: Exchange, attempt_fn, tried: list[Backend]):
        backend = ex.route.pick(tried, ex.affinity_key)
        if backend is None:
            if ex.last_failure is not None:  # every replica tried: answer with the last failure
                failure = ex.last_failure
                raise UpstreamFailure(
                    failure.status,
                    failure.body,
                    failure.reason,
                    failure.content_type,
                    headers=failure.headers,
                )
            raise UpstreamFailure(
                503,
                error_body(
                    503, f"No healthy backend for model '{ex.route.name}'.", "no_healthy_backend"
                ),
                "no_backend",
                headers={"Retry-After": str(self.health.retry_after_s())},
            )
        tried.append(backend)
        ex.backend = backend.label
        backend.waiting.add(ex)
        try:
            return await attempt_fn(ex, backend)
        except Retryable as failure:
            ex.last_failure = failure
            raise
        except asyncio.CancelledError:
            if ex.evicted_from is not backend:
                raise  # the client went away, or shutdown
            # Our backend was ejected while we waited for it (see HealthMonitor.evict): the
            # client has seen nothing yet, so this is a failure like any other, worth a retry.
            ex.evicted_from = None
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            failure = Retryable(
                502,
                error_body(502, "The upstream was ejected while answering.", "upstream_ejected"),
                "ejected",
            )
            ex.last_failure = failure
            raise failure from None
        finally:
            backend.waiting.discard(ex)

    # ---- one attempt ----

    def _client_timeout(self, connect_s: float) -> aiohttp.ClientTimeout:
        timeout = self._client_timeouts.get(connect_s)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
            self._client_timeouts[connect_s] = timeout
        return timeout

    async def _send(self, ex: Exchange, backend: Backend) -> aiohttp.ClientResponse:
        """Posts the request and waits for the response headers (the caller bounds the wait)."""
        config = ex.route.config
        headers = {"Content-Type": _JSON, "x-request-id": ex.request_id}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        try:
            return await self.session.post(
                backend.url + ex.path,
                data=ex.body,
                headers=headers,
                timeout=self._client_timeout(config.timeouts.connect_s),
            )
        except aiohttp.ConnectionTimeoutError as exc:
            self.metrics.timeouts.labels(ex.route.name, "connect").inc()
            raise self._retryable(
                ex,
                backend,
                "Timed out connecting to the upstream.",
                "upstream_connect_timeout",
                "connect_timeout",
                504,
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise self._retryable(
                ex,
                backend,
                "Could not connect to the upstream.",
                "upstream_connect_error",
                "connect",
                502,
            ) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise self._retryable(ex, backend, "The upstream closed the connection.") from exc

    async def _unary(
        self, ex: Exchange, backend: Backend
    ) -> tuple[int, bytes, str, dict[str, str]]:
        timeouts = ex.route.config.timeouts
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeouts.total_s - (time.monotonic() - ex.started)
        phase = "first_byte"
        backend.outstanding += 1
        try:
            async with asyncio.timeout_at(min(deadline, start + timeouts.first_byte_s)) as cm:
                resp = await self._send(ex, backend)
                try:
                    self.metrics.child(
                        self.metrics.upstream_latency, ex.route.name, backend.label
                    ).observe(loop.time() - start)
                    phase = "idle"
                    cm.reschedule(min(deadline, loop.time() + timeouts.idle_s))
                    body = await resp.read()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    resp.close()
                    raise self._retryable(
                        ex, backend, "The upstream closed the connection mid-response."
                    ) from exc
                finally:
                    resp.release()
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):
                raise
            raise self._timed_out(ex, backend, phase, loop.time() >= deadline) from exc
        finally:
            backend.outstanding -= 1
        status = resp.status
        content_type = resp.content_type or _JSON
        hints = backoff_hints(status, resp.headers)
        self._judge(ex, backend, status, body, content_type, hints)
        if status == 200 and content_type == _JSON:
            self._read_usage(ex, body)
        return status, body, content_type, hints

    def _judge(
        self,
        ex: Exchange,
        backend: Backend,
        status: int,
        body: bytes,
        content_type: str,
        hints: dict[str, str],
    ) -> None:
        """Passive health bookkeeping for an answered attempt; raises for retryable answers."""
        if status < 500:
            self.health.record_success(backend)
            return
        self._failed(ex, backend, answered=status not in _GATEWAY_STATUSES)
        if status in _RETRY_STATUSES:
            raise Retryable(status, body, f"status_{status}", content_type, headers=hints)

    def _failed(self, ex: Exchange, backend: Backend, answered: bool = False) -> None:
        """``answered``: the upstream answered with an error status of its own (500, 501, ...),
        which the request may have caused: health counts it once per request signature, the
        client and a digest of the body (computed only here, on failure)."""
        signature = hash((ex.client, ex.body)) if answered else None
        self.health.record_failure(ex.route, backend, signature)

    def _retryable(
        self,
        ex: Exchange,
        backend: Backend,
        message: str,
        code: str = "upstream_disconnected",
        reason: str = "disconnect",
        status: int = 502,
    ) -> Retryable:
        """Records a failed attempt; returns the failure to raise, with an OpenAI error body
        (by default: the upstream dropped the connection)."""
        self._failed(ex, backend)
        return Retryable(status, error_body(status, message, code), reason)

    def _timed_out(
        self, ex: Exchange, backend: Backend, phase: str, total: bool
    ) -> UpstreamFailure:
        kind = "total" if total else phase
        self.metrics.timeouts.labels(ex.route.name, kind).inc()
        self._failed(ex, backend)
        message = {
            "first_byte": "The upstream did not start answering in time.",
            "idle": "The upstream stalled while answering.",
            "total": "The request exceeded its total time limit.",
        }[kind]
        code = f"upstream_timeout_{kind}"
        return UpstreamFailure(
            504, error_body(504, message, code), f"timeout_{kind}", message=message
        )

    def _read_usage(self, ex: Exchange, body: bytes) -> None:
        """Decodes just the ``usage`` object (usually at the end) rather than the whole answer."""
        at = body.rfind(b'"usage"')
        if at < 0:
            return
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            colon = body.index(b":", at + 7)
            usage, _ = _DECODER.raw_decode(body[colon + 1 :].decode().lstrip())
            ex.usage(usage)

    def _rewrite_model(self, ex: Exchange, data: bytes) -> bytes:
        """Answers carry the upstream's own model name; show clients the served name instead."""
        config = ex.route.config
        if not config.upstream_model or config.upstream_model == config.name:
            return data
        wire = json.dumps(config.upstream_model).encode()
        served = json.dumps(config.name).encode()
        return data.replace(b'"model":' + wire, b'"model":' + served).replace(
            b'"model": ' + wire, b'"model": ' + served
        )

    # ---- streams ----

    async def _open_stream(
        self,
        ex: Exchange,
        backend: Backend,
    ) -> tuple[aiohttp.ClientResponse, bytes, Backend]:
        """Sends the request and waits for the first chunk; only then is the attempt a success."""
        timeouts = ex.route.config.timeouts
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeouts.total_s - (time.monotonic() - ex.started)
        backend.outstanding += 1
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout_at(min(deadline, start + timeouts.first_byte_s)):
                resp = await self._send(ex, backend)
                self.metrics.child(
                    self.metrics.upstream_latency, ex.route.name, backend.label
                ).observe(loop.time() - start)
                if resp.status != 200:
                    body = await resp.read()
                    resp.release()
                    content_type = resp.content_type or _JSON
                    hints = backoff_hints(resp.status, resp.headers)
                    self._judge(ex, backend, resp.status, body, content_type, hints)
                    raise UpstreamFailure(
                        resp.status, body, f"status_{resp.status}", content_type, headers=hints
                    )
                first = await resp.content.readany()
        except TimeoutError as exc:
            if resp is not None:
                resp.close()
            backend.outstanding -= 1
            if isinstance(exc, aiohttp.ClientError):
                raise
            raise self._timed_out(ex, backend, "first_byte", loop.time() >= deadline) from exc
        except aiohttp.ClientError as exc:
            if resp is not None:
                resp.close()
            backend.outstanding -= 1
            raise self._retryable(
                ex, backend, "The upstream closed the connection before streaming."
            ) from exc
        except BaseException:
            if resp is not None:
                resp.close()
            backend.outstanding -= 1
            raise
        if not first:
            resp.close()
            backend.outstanding -= 1
            raise self._retryable(ex, backend, "The upstream ended the stream before any data.")
        self.health.record_success(backend)
        ex.backend = backend.label
        return resp, first, backend

    async def _pump(
        self,
        request: web.Request,
        ex: Exchange,
        resp: aiohttp.ClientResponse,
        first: bytes,
        backend: Backend,
    ) -> web.StreamResponse:
        """Relays SSE events as they arrive; ends with an error event if the upstream fails."""
        timeouts = ex.route.config.timeouts
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeouts.total_s - (time.monotonic() - ex.started)
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **self._headers(ex)})
        relay = SseRelay(ex, ex.strip_usage, self._rewrite_pair(ex))
        ex.status = 200
        phase = "write"
        try:
            async with asyncio.timeout_at(deadline) as cm:
                await response.prepare(request)
                self.metrics.child(self.metrics.ttft, ex.route.name).observe(
                    time.monotonic() - ex.started
                )
                chunk = first
                while chunk:
                    out = relay.feed(chunk)
                    if out:
                        phase = "write"
                        cm.reschedule(deadline)
                        await response.write(out)
                    phase = "idle"
                    cm.reschedule(min(deadline, loop.time() + timeouts.idle_s))
                    chunk = await resp.content.readany()
                phase = "write"
                cm.reschedule(deadline)
                tail = relay.flush()
                if tail:
                    await response.write(tail)
                if not relay.done:
                    self._failed(ex, backend)
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
                failure = self._timed_out(ex, backend, phase, loop.time() >= deadline)
                ex.error = failure.reason
                await _try_write(
                    response,
                    sse_error_event(504, str(failure), f"upstream_{failure.reason}"),
                )
        except (
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            ConnectionResetError,
        ):
            if phase == "write":
                ex.status, ex.error = 499, "client_disconnected"
            else:
                self._failed(ex, backend)
                ex.error = "upstream_disconnected"
                await _try_write(
                    response,
                    sse_error_event(
                        502,
                        "The upstream failed in the middle of the stream.",
                        "upstream_disconnected",
                    ),
                )
        finally:
            backend.outstanding -= 1
            if relay.done and not relay.pending:
                resp.release()
            else:
                resp.close()  # drop the upstream connection: the upstream stops generating
        return response

    def _rewrite_pair(self, ex: Exchange) -> tuple[bytes, bytes] | None:
        config = ex.route.config
        if not config.upstream_model or config.upstream_model == config.name:
            return None
        return json.dumps(config.upstream_model).encode(), json.dumps(config.name).encode()


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    """Best effort: the error event cannot reach a client that has gone."""
    try:
        if response.prepared:
            await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass


def _events_end(data: bytes) -> int:
    """Offset just past the last complete SSE event in ``data`` (0 if none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class SseRelay:
    """Cuts the upstream byte stream at event boundaries and passes events through unchanged,
    except that it reads usage, drops the usage-only event a client did not ask for, and maps the
    upstream's model name back to the served one."""

    __slots__ = ("done", "ex", "pending", "rewrite", "strip_usage")

    def __init__(
        self, ex: Exchange, strip_usage: bool, rewrite: tuple[bytes, bytes] | None
    ) -> None:
        self.ex = ex
        self.strip_usage = strip_usage
        self.rewrite = rewrite
        self.pending = b""
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk if self.pending else chunk
        end = _events_end(data)
        if end == 0:
            self.pending = data
            return b""
        self.pending = data[end:]
        return self._process(data[:end])

    def flush(self) -> bytes:
        data, self.pending = self.pending, b""
        return self._process(data) if data else b""

    def _process(self, events: bytes) -> bytes:
        if b"data: [DONE]" in events or b"data:[DONE]" in events:
            self.done = True
        if b'"usage"' in events:
            events = self._usage(events)
        if self.rewrite:
            wire, served = self.rewrite
            events = events.replace(b'"model":' + wire, b'"model":' + served).replace(
                b'"model": ' + wire, b'"model": ' + served
            )
        return events

    def _usage(self, events: bytes) -> bytes:
        if b"\r\n" in events:
            events = events.replace(b"\r\n", b"\n")
        kept = []
        for event in events.split(b"\n\n"):
            if (
                b'"usage"' in event
                and event.startswith(b"data:")
                and b'"usage":null' not in event
                and b'"usage": null' not in event
            ):
                try:
                    obj = json.loads(event[5:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and obj.get("usage"):
                    self.ex.usage(obj["usage"])
                    if self.strip_usage and not obj.get("choices"):
                        continue
            kept.append(event)
        return b"\n\n".join(kept)
