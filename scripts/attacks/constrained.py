"""What the constraint attacks (issue 29) share: a constrained request (its body from
scripts/fuzzer/constraints.py) sent through the gateway, each 200's output judged against its
constraint by an independent validator (scripts/fuzzer/output_check.py), and the answers summed
up."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from scripts.attacks.context import Ctx
from scripts.attacks.fleet import MODEL
from scripts.attacks.raw_http import Answer, http_request
from scripts.fuzzer.constraints import Constraint, constrained_body
from scripts.fuzzer.output_check import check, outputs


@dataclass
class Sent:
    answer: Answer
    body_bytes: int
    finish_reasons: list[str | None] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # why each broken output breaks it


async def send_constrained(
    ctx: Ctx, c: Constraint, path: str, timeout: float, max_tokens: int = 8, model: str = MODEL
) -> Sent:
    body = json.dumps(constrained_body(c, model, path, max_tokens)).encode()
    answer = await http_request(ctx.fleet.url, "POST", path, body, timeout=timeout)
    sent = Sent(answer, len(body))
    if answer.status == 200:
        found = outputs(answer.body)
        if not found:
            sent.broken.append(f"a 200 without choices: {answer.body[:80]!r}")
        for out in found or []:
            sent.finish_reasons.append(out.finish_reason)
            verdict, detail = check(c, out)
            if verdict == "broken":
                sent.broken.append(detail)
    return sent


def counted(items: list[Any]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in Counter(map(str, items)).items())


def answers_figures(answers: list[Answer]) -> dict[str, Any]:
    return {
        "answers": counted([a.text() for a in answers]),
        "answer_max_s": round(max((a.seconds for a in answers), default=0.0), 2),
    }


def sent_figures(sent: list[Sent]) -> dict[str, Any]:
    """The answers, the longest wait, and the 200s whose output breaks its constraint."""
    broken = [b for s in sent for b in s.broken]
    return {
        **answers_figures([s.answer for s in sent]),
        "finish_reasons": counted([f for s in sent for f in s.finish_reasons]),
        "broken_200": len(broken),
        **({"broken_example": broken[0][:160]} if broken else {}),
    }
