"""Attacks h2 and h3: constraints that compile for a long time.

h2: ``patternProperties`` with 500, then 2,000 patterns (compiled pairwise: 51 s and > 15 min
at the baseline), each given up after --compile-give-up-s; then a tiny schema, timed: does the
given-up compile still run (the engine's CPU while the tiny one waits) and hold it up?
h3: ``anyOf`` of 5,000 object branches (577 KB), --anyof-variants distinct ones one after
another (each a new compile), and the regex ``(ab{1000}){1000}``; every 200 is checked against
its constraint (the baseline ends some with finish_reason ``abort`` and an output that breaks it).
"""

from __future__ import annotations

import time
from typing import Any

from common.processes import cpu_seconds, descendants
from scripts.attacks.constrained import send_constrained, sent_figures
from scripts.attacks.context import Ctx
from scripts.attacks.raw_http import CHAT
from scripts.fuzzer.constraints import Constraint, anyof_objects, counted_regex, pattern_properties

TINY = Constraint("json_schema", {"type": "boolean", "title": "h2"})  # compiled here first
TINY_TIMEOUT_S = 30.0
ANYOF_TIMEOUT_S = 120.0


def engine_cpu_s(pid: int | None) -> float:
    """CPU seconds of the engine and its live descendants so far."""
    if pid is None:
        return 0.0
    return sum(cpu_seconds(p) or 0.0 for p in (pid, *descendants(pid)))


async def pattern_properties_stall(ctx: Ctx) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for count in (500, 2000):
        schema = Constraint("json_schema", pattern_properties(count))
        sent = await send_constrained(ctx, schema, CHAT, ctx.args.compile_give_up_s)
        figures[f"patterns_{count}_bytes"] = sent.body_bytes
        figures[f"patterns_{count}_answer"] = sent.answer.text()
    pid, cpu0, t0 = ctx.fleet.engine_pid, engine_cpu_s(ctx.fleet.engine_pid), time.monotonic()
    tiny = await send_constrained(ctx, TINY, CHAT, TINY_TIMEOUT_S, max_tokens=2)
    busy = (engine_cpu_s(pid) - cpu0) / max(time.monotonic() - t0, 1e-3)
    figures |= {
        "tiny_schema_answer": tiny.answer.text(),
        "tiny_schema_s": round(tiny.answer.seconds, 2),
        "engine_cores_busy_while_tiny_waited": round(busy, 2),  # the victim's share included
    }
    return {"give_up_s": ctx.args.compile_give_up_s, "figures": figures}


async def anyof_stall(ctx: Ctx) -> dict[str, Any]:
    sent = []
    for variant in range(ctx.args.anyof_variants):
        schema = Constraint("json_schema", anyof_objects(5000, tag=f"v{variant}_"))
        sent.append(await send_constrained(ctx, schema, CHAT, ANYOF_TIMEOUT_S))
    regex = Constraint("regex", counted_regex(1000, 1000), python_regex=True)
    sent.append(await send_constrained(ctx, regex, CHAT, ANYOF_TIMEOUT_S))
    figures = {
        "anyof_body_bytes": sent[0].body_bytes,
        "variant_answers_s": [round(s.answer.seconds, 2) for s in sent[:-1]],
        "regex_answer": sent[-1].answer.text(),
        **sent_figures(sent),
    }
    return {"sends": [s.answer.brief() for s in sent], "figures": figures}
