"""Attacks h6a and h6b, on the on-demand model (fleet.ON_DEMAND_MODEL) through /admin.

h6a: park and load it in a loop for --residency-s while two clients send it small requests:
how many answers are 503 ``engine_sleeping`` rather than held until it is awake again.
h6b: an unload while it loads, with requests held for it (a cold load by /admin, one its held
requests start, a wake by /admin): what the load, the unload and the held requests answer, the
state it ends in, and whether a later request still loads it.
Both end with it unloaded (its memory back for the attacks after)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from scripts.attacks.constrained import answers_figures, counted
from scripts.attacks.context import Ctx
from scripts.attacks.fleet import ON_DEMAND_MODEL
from scripts.attacks.raw_http import CHAT, Answer, http_request

BODY = json.dumps(
    {"model": ON_DEMAND_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
).encode()
CYCLES_CAP = 1000  # a park and a wake of an idle engine take about 0.1 s each
CLIENTS = 2
REQUEST_TIMEOUT_S = 60.0
HELD = 3
STATE_WAIT_S = 20.0
SETTLE_WAIT_S = 60.0
LOADING = ("starting", "waking")
MODEL_PATH = f"/admin/models/{ON_DEMAND_MODEL}"


async def admin(ctx: Ctx, action: str) -> str:
    """POST /admin/models/<on-demand>/<action>: its status and error code."""
    status, body = await asyncio.to_thread(ctx.fleet.admin, "POST", f"{MODEL_PATH}/{action}")
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return f"{status} {code}" if code else str(status if status is not None else body)


async def status(ctx: Ctx) -> dict[str, Any]:
    return await asyncio.to_thread(ctx.fleet.model_status, ON_DEMAND_MODEL)


async def settled(ctx: Ctx) -> dict[str, Any]:
    return await asyncio.to_thread(ctx.fleet.wait_settled, ON_DEMAND_MODEL, SETTLE_WAIT_S)


def send(ctx: Ctx) -> asyncio.Task[Answer]:
    return asyncio.create_task(
        http_request(ctx.fleet.url, "POST", CHAT, BODY, timeout=REQUEST_TIMEOUT_S)
    )


async def park_load_loop(ctx: Ctx) -> dict[str, Any]:
    first_load = await admin(ctx, "load")  # a cold start, before the loop
    answers: list[Answer] = []
    deadline = time.monotonic() + ctx.args.residency_s

    async def client() -> None:
        while time.monotonic() < deadline:
            answers.append(await send(ctx))
            await asyncio.sleep(0.05)

    clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
    cycles: list[str] = []
    try:
        while time.monotonic() < deadline and len(cycles) < CYCLES_CAP:
            cycles.append(f"park {await admin(ctx, 'park')}, load {await admin(ctx, 'load')}")
        await asyncio.gather(*clients)
    finally:  # the attack's cap cancels it: no client outlives it
        for task in clients:
            task.cancel()
    end = await settled(ctx)
    cleanup = await admin(ctx, "unload")
    sleeping = sum(a.code == "engine_sleeping" for a in answers)
    figures = {
        "first_load": first_load,
        "cycles": len(cycles),
        "admin_answers": counted(cycles),
        "requests": len(answers),
        **answers_figures(answers),
        "engine_sleeping": sleeping,
        "engine_sleeping_pct": round(100 * sleeping / len(answers), 1) if answers else None,
        "on_demand_state_end": end["state"],
        "on_demand_restarts": end["restarts"],
    }
    return {"cleanup_unload": cleanup, "figures": figures}


async def interrupted_load(ctx: Ctx, start: str, by_admin: bool) -> dict[str, Any]:
    """From ``start`` (stopped or parked): a load (by /admin, or by the held requests
    themselves), an unload once it is starting or waking with the requests held; then a later
    request."""
    await admin(ctx, "unload")
    if start == "parked":
        await admin(ctx, "load")
        await admin(ctx, "park")
    t0 = time.monotonic()
    load = asyncio.create_task(admin(ctx, "load")) if by_admin else None
    held = [send(ctx) for _ in range(HELD)]
    while (await status(ctx))["state"] not in LOADING and time.monotonic() < t0 + STATE_WAIT_S:
        await asyncio.sleep(0.05)
    if start == "stopped":
        await asyncio.sleep(1.0)  # well into the cold start, every request in the hold line
    before = await status(ctx)
    unload_at_s = time.monotonic() - t0
    unload = await admin(ctx, "unload")
    load_answer = await load if load is not None else None
    held_answers = await asyncio.gather(*held)
    after_unload = await settled(ctx)
    later = await send(ctx)
    end = await settled(ctx)
    return {
        "state_at_unload": before["state"],
        "unload_at_s": round(unload_at_s, 2),
        "held_at_unload": before["held"],
        "unload_answer": unload,
        **({"load_answer": load_answer} if by_admin else {}),
        "held_answers": counted([a.text() for a in held_answers]),
        "state_after_unload": after_unload["state"],
        "later_request_answer": later.text(),
        "later_request_s": round(later.seconds, 2),
        "state_end": end["state"],
    }


async def unload_during_load(ctx: Ctx) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for start, by in (("stopped", "admin"), ("stopped", "requests"), ("parked", "admin")):
        result = await interrupted_load(ctx, start, by_admin=by == "admin")
        figures |= {f"{start}_{by}_{key}": value for key, value in result.items()}
    cleanup = await admin(ctx, "unload")
    return {"cleanup_unload": cleanup, "figures": figures}
