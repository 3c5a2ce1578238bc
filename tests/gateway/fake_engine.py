"""Stands in for ``python -m engine`` in pool tests: takes the engine's flags, serves the mock
upstream's API under ``--served-model-name``, and answers /ready only after ``--ready-delay-s``.
It parks and wakes as the engine does (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``:
asleep, /ready and completions answer 503) and reports a memory footprint on ``GET /status``, and
its start-up stage there: ``weights`` with a percent growing over ``--ready-delay-s`` (but its
last ``--between-phases-s``, ``loading``: no phase running), then ``ready``.

Test-only flags (passed through ``engine_args`` in models.yaml): ``--ready-delay-s S``,
``--fail-start`` (exit 3 at once, as an engine with a bad model would), ``--first-start-only PATH``
(the first start creates PATH; a start that finds it fails like ``--fail-start``), ``--rss-bytes
N`` and ``--parked-rss-bytes N`` (what /status reports awake and asleep),
``--structured-headroom-bytes N`` (what structured outputs may still add, awake),
``--compiled-rss-bytes N`` (awake after a request with the mock key ``compile``, until it parks:
its headroom then spent), ``--weights-bytes N`` (what a park releases, reported awake),
``--wake-delay-s S``,
``--crash-after-ready-s S`` (exit 1 that long after its first /ready 200: a crash while serving).

Per request, besides the mock upstream's ``mock`` keys: ``arrive_delay_ms`` waits before looking
whether the engine sleeps (a request still on its way in when a sleep lands). ``GET /stats``
counts the requests answered ``engine_sleeping`` (``asleep_answers``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a plain script

from scripts.mock_upstream import MockServer, serve


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-delay-s", type=float, default=0.0)
    parser.add_argument("--wake-delay-s", type=float, default=0.05)
    parser.add_argument("--fail-start", action="store_true")
    parser.add_argument("--first-start-only", type=Path, default=None)
    parser.add_argument("--rss-bytes", type=int, default=0)
    parser.add_argument("--parked-rss-bytes", type=int, default=0)
    parser.add_argument("--structured-headroom-bytes", type=int, default=0)
    parser.add_argument("--compiled-rss-bytes", type=int, default=0)
    parser.add_argument("--weights-bytes", type=int, default=0)
    parser.add_argument("--crash-after-ready-s", type=float, default=None)
    parser.add_argument("--between-phases-s", type=float, default=0.0)
    args, _engine_flags = parser.parse_known_args()
    marker = args.first_start_only
    if args.fail_start or not Path(args.model).exists() or (marker and marker.exists()):
        print("fake engine: cannot load the model", flush=True)
        sys.exit(3)
    if marker:
        marker.touch()
    print(f"fake engine: loading {args.model}", flush=True)
    mock = MockServer(args.served_model_name)
    started = time.monotonic()
    ready_at = started + args.ready_delay_s
    sleeping = {"now": False, "parks": 0, "wakes": 0}
    compiled = {"now": False}  # a request asked for a grammar: the headroom is spent
    base_ready = mock.ready
    base_completions = mock.completions

    mock.stats["asleep_answers"] = 0

    def asleep() -> web.Response:
        mock.stats["asleep_answers"] += 1
        error = {"message": "asleep", "type": "server_error", "param": None,
                 "code": "engine_sleeping"}  # fmt: skip
        return web.json_response({"error": error}, status=503, headers={"Retry-After": "1"})

    def crash_soon() -> None:
        if args.crash_after_ready_s is not None:
            asyncio.get_running_loop().call_later(args.crash_after_ready_s, lambda: os._exit(1))
            args.crash_after_ready_s = None  # once

    async def ready(request: web.Request) -> web.Response:
        if time.monotonic() < ready_at:
            return web.json_response({"status": "loading"}, status=503)
        if sleeping["now"]:
            return web.json_response({"status": "sleeping"}, status=503)
        crash_soon()
        return await base_ready(request)

    async def completions(request: web.Request) -> web.StreamResponse:
        keys = (await request.json()).get("mock") or {}
        arrive_delay_ms = keys.get("arrive_delay_ms")
        compiled["now"] = compiled["now"] or bool(keys.get("compile"))
        if arrive_delay_ms:
            await asyncio.sleep(arrive_delay_ms / 1000)
        if sleeping["now"]:
            return asleep()
        return await base_completions(request)

    async def sleep(request: web.Request) -> web.Response:
        sleeping["now"] = True
        sleeping["parks"] += 1
        compiled["now"] = False
        return web.json_response({"is_sleeping": True})

    async def wake_up(request: web.Request) -> web.Response:
        await asyncio.sleep(args.wake_delay_s)
        sleeping["now"] = False
        sleeping["wakes"] += 1
        return web.json_response({"is_sleeping": False})

    def startup() -> dict:
        now = time.monotonic()
        if now >= ready_at:
            return {"stage": "ready", "percent": None, "stage_s": round(now - ready_at, 3)}
        if now >= ready_at - args.between_phases_s:
            return {"stage": "loading", "percent": None, "stage_s": 0.0}
        percent = round(100 * (now - started) / args.ready_delay_s, 1)
        return {"stage": "weights", "percent": percent, "stage_s": round(now - started, 3)}

    async def status(request: web.Request) -> web.Response:
        rss = args.parked_rss_bytes if sleeping["now"] else args.rss_bytes
        headroom = 0 if sleeping["now"] else args.structured_headroom_bytes
        if compiled["now"] and args.compiled_rss_bytes:
            rss, headroom = args.compiled_rss_bytes, 0
        memory = {"rss_bytes": rss} if rss else {}
        if headroom:
            memory["structured_headroom_bytes"] = headroom
        if args.weights_bytes and not sleeping["now"]:
            memory["weights_bytes"] = args.weights_bytes
        park = {"parks": sleeping["parks"], "wakes": sleeping["wakes"]}
        body = {"sleeping": sleeping["now"], "device": "cpu", "memory": memory, "park": park,
                "startup": startup()}  # fmt: skip
        return web.json_response(body)

    mock.ready = ready  # type: ignore[method-assign]
    mock.completions = completions  # type: ignore[method-assign]
    app = mock.app()
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get(
        "/is_sleeping", lambda _: web.json_response({"is_sleeping": sleeping["now"]})
    )
    app.router.add_get("/status", status)
    mock.app = lambda: app  # type: ignore[method-assign]
    serve(mock, args.host, args.port)


if __name__ == "__main__":
    main()
