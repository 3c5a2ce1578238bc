"""Attack h4: 40 distinct regexes ``(ab{1000}){1000}cN`` (tiny bodies, each a huge compiled
automaton kept in the compile cache): the engine's RSS (with its descendants) before and after,
and each 200 checked against its regex."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.processes import TreeRss
from scripts.attacks.constrained import send_constrained, sent_figures
from scripts.attacks.context import ATTACK_CAP_S, Ctx
from scripts.attacks.raw_http import CHAT
from scripts.fuzzer.constraints import Constraint, counted_regex

REGEXES = 40
REGEX_TIMEOUT_S = 60.0
SENDS_CAP_S = ATTACK_CAP_S - 60  # room for the answers to come in within the attack's cap


def rss_mb(pid: int | None) -> float | None:
    rss = TreeRss().rss_bytes(pid) if pid else None
    return round(rss / 2**20, 1) if rss is not None else None


async def regex_cache(ctx: Ctx) -> dict[str, Any]:
    pid = ctx.fleet.engine_pid
    before = rss_mb(pid)
    t0 = time.monotonic()
    sent = []
    for i in range(REGEXES):
        if time.monotonic() > t0 + SENDS_CAP_S:
            break
        regex = Constraint("regex", counted_regex(1000, 1000, f"c{i}"), python_regex=True)
        sent.append(await send_constrained(ctx, regex, CHAT, REGEX_TIMEOUT_S))
    await asyncio.sleep(1.0)  # the last compile's memory settles
    after = rss_mb(pid)
    figures = {
        "regexes_sent": len(sent),
        "body_bytes": sent[0].body_bytes if sent else None,
        **sent_figures(sent),
        "engine_rss_before_mb": before,
        "engine_rss_after_mb": after,
        "engine_rss_growth_mb": round(after - before, 1) if before and after else None,
    }
    return {"figures": figures}
