"""Attack h1: one constraint that overflows the grammar compiler's stack, sent a few times
through the gateway: a JSON schema whose ``$ref`` chain is 3,000 deep (response_format), a Lark
grammar of 3,000 chained rules (structured_outputs on /v1/completions), tool parameters with a
2,500-deep chain under ``tool_choice: "required"`` (their prompt is too long as well: refused,
once the compile is done). At the baseline each one kills the engine, and the gateway re-sends
the held request to the restarted one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from scripts.attacks.constrained import send_constrained, sent_figures
from scripts.attacks.context import Ctx
from scripts.attacks.fleet import MODEL
from scripts.attacks.raw_http import CHAT, COMPLETIONS
from scripts.fuzzer.constraints import Constraint, lark_chain, ref_chain, ref_chain_tools

SETTLE_WAIT_S = 90.0  # after the last send: until the model is ready (or failed) again

VARIANTS: dict[str, Callable[[], tuple[Constraint, str]]] = {
    "schema": lambda: (Constraint("json_schema", ref_chain(3000)), CHAT),
    "lark": lambda: (Constraint("grammar", lark_chain(3000)), COMPLETIONS),
    "tools": lambda: (Constraint("tools", ref_chain_tools(2500)), CHAT),
}


def grammar_crash(variant: str) -> Callable[[Ctx], Awaitable[dict]]:
    async def attack(ctx: Ctx) -> dict[str, Any]:
        constraint, path = VARIANTS[variant]()
        sent = [
            await send_constrained(ctx, constraint, path, ctx.args.crash_timeout_s)
            for _ in range(ctx.args.crash_sends)
        ]
        settled = await asyncio.to_thread(ctx.fleet.wait_settled, MODEL, SETTLE_WAIT_S)
        figures = {
            "body_bytes": sent[0].body_bytes,
            **sent_figures(sent),
            "model_state_settled": settled["state"],
            "settled_after_s": settled["settled_after_s"],
        }
        return {"sends": [s.answer.brief() for s in sent], "figures": figures}

    return attack
