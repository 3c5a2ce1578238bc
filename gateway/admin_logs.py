"""``GET /admin/logs`` (admin key): one engine replica's output, from its log file
(gateway/engines/logs.py).

``model`` (a local model's name or alias), ``replica`` (its index, default 0) and ``tail`` (lines,
default 100, at most ``MAX_TAIL``) answer plain text, a line each. ``follow=1`` answers
Server-Sent Events instead: the tail, then every line as the engine writes it (across rotations
and restarts: the log belongs to the replica's slot) as one ``data:`` event each, until the client
leaves or the gateway stops; a comment every ``KEEPALIVE_S`` of silence, and a line saying how
many lines a client that read too slowly missed.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from common.errors import RequestRefused, excerpt
from gateway.admin_models import local_model
from gateway.engines.logs import EngineLog
from gateway.request_keys import REQUEST_ID
from gateway.state import GATEWAY_KEY, Gateway

DEFAULT_TAIL = 100
MAX_TAIL = 10_000
KEEPALIVE_S = 15.0
_FLAGS = {"1": True, "true": True, "0": False, "false": False}


async def logs(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    engine_log = _engine_log(gw, request.query)
    tail = _tail(request.query.get("tail"))
    follow = _FLAGS.get(request.query.get("follow", "0").lower())
    if follow is None:
        raise RequestRefused(400, "'follow' must be 1 or 0.", param="follow", code="invalid_value")
    if follow:
        return await _follow(request, engine_log, tail)
    text = "".join(line + "\n" for line in engine_log.tail(tail))
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def _engine_log(gw: Gateway, query: Mapping[str, str]) -> EngineLog:
    name = query.get("model")
    if not name:
        raise RequestRefused(
            400, "'model' is required: a local model's name.", param="model", code="invalid_value"
        )
    model = local_model(gw, name, "model")
    given = query.get("replica", "0")
    index = int(given) if _count(given) and len(given) < 6 else None
    if index is None:
        raise RequestRefused(
            400,
            f"'replica' must be a replica's index (0, 1, ...), got '{excerpt(given)}'.",
            param="replica",
            code="invalid_value",
        )
    # A replica running now, or one the model may have: its log stays after its process.
    known = {r.index for r in gw.pool.replicas.get(model, [])}
    if index not in known and index >= gw.residency.models[model].config.replicas:
        raise RequestRefused(
            404, f"Model '{model}' has no replica {index}.", param="replica",
            code="replica_not_found",
        )  # fmt: skip
    return gw.pool.logs.replica(model, index)


def _tail(given: str | None) -> int:
    if given is None:
        return DEFAULT_TAIL
    if not _count(given) or int(given) > MAX_TAIL:
        raise RequestRefused(
            400,
            f"'tail' must be a line count from 0 to {MAX_TAIL}, got '{excerpt(given)}'.",
            param="tail",
            code="invalid_value",
        )
    return int(given)


async def _follow(request: web.Request, engine_log: EngineLog, tail: int) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "X-Accel-Buffering": "no",  # a proxy in front must not hold the lines back
            "x-request-id": request[REQUEST_ID],
        }
    )
    # Following starts before the tail is read, with no await between: no line falls in a gap.
    follower = engine_log.follow()
    try:
        lines = engine_log.tail(tail)
        await response.prepare(request)
        while True:
            if follower.dropped:
                lines.append(f"[modelyard: {follower.dropped} lines dropped: read too slowly]")
                follower.dropped = 0
            await response.write(_events(lines) if lines else b": keep-alive\n\n")
            if follower.closed:
                break
            lines = await follower.next_lines(KEEPALIVE_S)
    except ConnectionError:  # the client left
        pass
    finally:
        engine_log.unfollow(follower)
    return response


def _count(given: str) -> bool:
    return given.isascii() and given.isdigit()


def _events(lines: list[str]) -> bytes:
    """One SSE event per line. A carriage return would end an SSE line early: a line keeps what
    follows its last one (what a terminal shows of a progress bar's redraws)."""
    shown = (line.rpartition("\r")[2] for line in lines)
    return "".join(f"data: {line}\n\n" for line in shown).encode()
