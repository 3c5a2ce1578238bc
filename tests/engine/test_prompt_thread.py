"""Prompts templated and tokenised off the event loop (on the prompt thread), with a size
cap checked before that work: max_model_len tokens of the longest token, four times."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import aiohttp
import pytest

from engine.errors import InvalidRequestError
from engine.serving.requests import RequestLimits, longest_token_chars, parse_completion_request
from tests.engine.json_requests import (
    CHAT,
    COMPLETIONS,
    MSG,
    assert_still_serves,
    openai_error,
    post,
)
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(60)


class SlowTokenizer:
    """A tokenizer whose calls take ``delay_s`` and are recorded with their thread's name."""

    delay_s = 0.0
    threads: list[str] = []  # noqa: RUF012 (shared by the copies the engine makes)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet: copy.deepcopy builds the copy without __init__
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        SlowTokenizer.threads.append(threading.current_thread().name)
        time.sleep(SlowTokenizer.delay_s)
        return self._inner(*args, **kwargs)


@pytest.fixture
def slow_tokenizer(tokenizer):
    SlowTokenizer.threads.clear()
    SlowTokenizer.delay_s = 0.0
    yield SlowTokenizer(tokenizer)
    SlowTokenizer.delay_s = 0.0


async def _max_health_latency(url: str, until: asyncio.Task) -> float:
    """Polls /health every 20 ms while ``until`` runs; the slowest answer, in seconds."""
    worst = 0.0
    async with aiohttp.ClientSession() as session:
        while not until.done():
            started = time.monotonic()
            async with session.get(url + "/health") as reply:
                assert reply.status == 200
            worst = max(worst, time.monotonic() - started)
            await asyncio.sleep(0.02)
    return worst


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize"])
async def test_a_huge_prompt_is_refused_before_tokenising(slow_tokenizer, path):
    srv = await InProcessServer(
        lambda: FakeCore(slow_tokenizer, max_model_len=64), ["tiny"], max_body_bytes=8 << 20
    ).start()
    try:
        text = "word " * 800_000  # 4 MB
        if path == CHAT:
            body, param = {"messages": [{"role": "user", "content": text}]}, "messages"
        else:
            body, param = {"prompt": text}, "prompt"
        request = asyncio.create_task(post(srv.url + path, {"model": "tiny", **body}))
        worst = await _max_health_latency(srv.url, request)
        status, payload, _ = await request
        assert status == 400
        message = openai_error(payload, code="context_length_exceeded", param=param)["message"]
        assert "4000000 characters" in message
        assert SlowTokenizer.threads == []  # refused without tokenising
        assert worst < 0.5
        await assert_still_serves(srv)
    finally:
        await srv.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "hello there", "max_tokens": 2}),
        (CHAT, {"messages": MSG, "max_tokens": 2}),
        ("/tokenize", {"prompt": "hello there"}),
        ("/tokenize", {"messages": MSG}),
    ],
)
async def test_tokenising_runs_off_the_event_loop(slow_tokenizer, path, body):
    SlowTokenizer.delay_s = 1.0
    srv = await InProcessServer(
        lambda: FakeCore(slow_tokenizer, max_model_len=64), ["tiny"]
    ).start()
    try:
        request = asyncio.create_task(post(srv.url + path, {"model": "tiny", **body}))
        worst = await _max_health_latency(srv.url, request)
        assert (await request)[0] == 200
        assert worst < 0.5  # the 1 s tokenisation did not hold /health up
        assert SlowTokenizer.threads and all(
            name.startswith("engine-prompts") for name in SlowTokenizer.threads
        )
    finally:
        await srv.stop()


async def test_a_token_id_prompt_over_the_context_is_refused_before_its_scan(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer, max_model_len=64), ["tiny"]).start()
    try:
        status, payload, _ = await post(srv.url + COMPLETIONS, {"prompt": [5] * 500_000})
        assert status == 400
        openai_error(payload, code="context_length_exceeded", param="prompt")
        await assert_still_serves(srv)
    finally:
        await srv.stop()


def test_the_prompt_cap_is_max_model_len_tokens_of_the_longest_token_four_times(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(token) for token in tokenizer.get_vocab())
    limits = RequestLimits(max_model_len=64, max_n=4, vocab_size=512, longest_token_chars=longest)
    assert limits.max_prompt_chars == 64 * longest * 4
    parse_completion_request({"prompt": "x" * limits.max_prompt_chars}, limits)
    with pytest.raises(InvalidRequestError) as refused:
        parse_completion_request({"prompt": "x" * (limits.max_prompt_chars + 1)}, limits)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_a_chat_of_more_messages_than_tokens_is_refused_before_templating(
    slow_tokenizer, path
):
    """120,000 empty messages (3.96 MB) passed the character cap and held the prompt thread
    4-8 s each: every message takes a token at least, so more than max_model_len are refused
    at once, on the event loop."""
    srv = await InProcessServer(
        lambda: FakeCore(slow_tokenizer, max_model_len=64), ["tiny"], max_body_bytes=8 << 20
    ).start()
    try:
        messages = [{"role": "user", "content": ""}] * 120_000
        request = asyncio.create_task(post(srv.url + path, {"model": "tiny", "messages": messages}))
        worst = await _max_health_latency(srv.url, request)
        status, payload, _ = await request
        assert status == 400
        error = openai_error(payload, code="context_length_exceeded", param="messages")
        assert "120000 messages" in error["message"]
        assert SlowTokenizer.threads == [] and worst < 0.5
        await assert_still_serves(srv)
    finally:
        await srv.stop()


async def test_the_template_output_counts_against_the_prompt_cap(slow_tokenizer):
    """Messages whose texts fit the cap, but whose template output does not: refused before
    tokenising."""
    srv = await InProcessServer(
        lambda: FakeCore(slow_tokenizer, max_model_len=64), ["tiny"]
    ).start()
    try:
        cap = 64 * longest_token_chars(slow_tokenizer) * 4
        count = 60
        text = "x" * (cap // count - 1)  # the texts alone fit; each message's markers do not
        messages = [{"role": "user", "content": text}] * count
        status, payload, _ = await post(srv.url + CHAT, {"model": "tiny", "messages": messages})
        assert status == 400
        error = openai_error(payload, code="context_length_exceeded", param="messages")
        assert f"at most {cap}" in error["message"]
        assert SlowTokenizer.threads == []
    finally:
        await srv.stop()
