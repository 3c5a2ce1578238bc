"""Attack 2: ``n=10000`` on /v1/completions, the client giving up; how long the engine's queue
and the victim's failures outlast the answer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from scripts.attacks.context import Ctx
from scripts.attacks.fleet import MAX_NUM_SEQS, MODEL
from scripts.attacks.raw_http import COMPLETIONS, answer_figures, http_request

RECOVERY_CAP_S = 120.0


async def engine_waiting(ctx: Ctx) -> float | None:
    answer = await http_request(ctx.fleet.engine_url, "GET", "/metrics", timeout=5)
    for line in answer.body.decode(errors="replace").splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def many_choices(ctx: Ctx) -> dict[str, Any]:
    """n=10000 through the gateway, given up after --give-up-s; then, from its answer (or the
    give-up), how long the engine keeps more than max_num_seqs requests waiting and how long the
    victim's requests keep failing."""
    t0 = time.monotonic()
    samples: list[tuple[float, float]] = []

    async def poll_metrics() -> None:
        while True:  # cancelled below, after at most RECOVERY_CAP_S
            value = await engine_waiting(ctx)
            if value is not None:
                samples.append((time.monotonic(), value))
            await asyncio.sleep(0.25)

    def high_until() -> float:
        return max((t for t, v in samples if v > MAX_NUM_SEQS), default=t0)

    def failing_until() -> float:
        chats = [p for p in list(ctx.victim.chats) if p.start >= t0 and p.end is not None]
        return max((p.end for p in chats if not p.ok), default=t0)

    def recovered() -> bool:
        queue_low = bool(samples) and samples[-1][0] > high_until()
        return queue_low and ctx.victim.first_ok_since(failing_until()) is not None

    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 10000}).encode()
    poller = asyncio.create_task(poll_metrics())
    try:
        answer = await http_request(
            ctx.fleet.url, "POST", COMPLETIONS, body, timeout=ctx.args.give_up_s
        )
        answered = time.monotonic()
        while time.monotonic() < answered + RECOVERY_CAP_S and not recovered():
            await asyncio.sleep(0.25)
    finally:
        poller.cancel()
    figures = {
        **answer_figures(answer),
        "waiting_max": max((v for _, v in samples), default=None),
        "waiting_high_after_answer_s": round(max(0.0, high_until() - answered), 2),
        "victim_failing_after_answer_s": round(max(0.0, failing_until() - answered), 2),
    }
    capped = {} if recovered() else {"capped_at_s": RECOVERY_CAP_S}
    return {
        **answer.brief(),
        "waiting_high_means": f"> {MAX_NUM_SEQS}",
        **capped,
        "figures": figures,
    }
