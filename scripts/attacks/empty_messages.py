"""Attack h5: two senders of 120,000 messages with empty content (3.96 MB, under the
character cap: no content to count) through the gateway, each one after another for
--flood-s, while the victim's plain requests wait for the prompt thread."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from scripts.attacks.constrained import answers_figures
from scripts.attacks.context import Ctx
from scripts.attacks.fleet import MODEL
from scripts.attacks.raw_http import CHAT, Answer, http_request

MESSAGES = 120_000
SENDERS = 2
SENDS_CAP = 20  # per sender
SEND_TIMEOUT_S = 60.0


def empty_messages_body() -> bytes:
    messages = [{"role": "user", "content": ""}] * MESSAGES
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()


async def empty_messages(ctx: Ctx) -> dict[str, Any]:
    body = empty_messages_body()
    deadline = time.monotonic() + ctx.args.flood_s

    async def sender() -> list[Answer]:
        answers: list[Answer] = []
        while time.monotonic() < deadline and len(answers) < SENDS_CAP:
            answers.append(
                await http_request(ctx.fleet.url, "POST", CHAT, body, timeout=SEND_TIMEOUT_S)
            )
        return answers

    answers = [
        a for batch in await asyncio.gather(*(sender() for _ in range(SENDERS))) for a in batch
    ]
    figures = {
        "body_bytes": len(body),
        "sends": len(answers),
        **answers_figures(answers),
    }
    return {"senders": SENDERS, "figures": figures}
