"""The engine against hostile requests: bounded n, choices counted in the queue bound, prompts
templated and tokenised off the event loop with a size cap before that work, 503s that say when
to come back."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import aiohttp
import pytest

from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer
from tests.tiny_models import build_tokenizer

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


async def _post(url: str, body: Any) -> tuple[int, dict, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=json.dumps(body), headers={"Content-Type": "application/json"}
        ) as reply,
    ):
        return reply.status, await reply.json(content_type=None), dict(reply.headers)


def _error(payload: dict, code: str | None = None, param: str | None = None) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def test_n_above_the_cap_is_400(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"]).start()
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": 10_000}
        status, payload, _ = await _post(srv.url + COMPLETIONS, body)
        assert status == 400
        assert "128" in _error(payload, param="n")["message"]
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**body, "n": 128})
        assert status == 200 and len(payload["choices"]) == 128
    finally:
        await srv.stop()


async def test_the_queue_bound_counts_choices_and_overload_says_retry_after(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_num_seqs=1, step_delay=0.05), ["tiny"], max_queue=4
    ).start()
    try:
        long = {"model": "tiny", "prompt": "Hello", "max_tokens": 40}
        running = asyncio.create_task(_post(srv.url + COMPLETIONS, long))
        await asyncio.sleep(0.2)  # running: the queue is empty again
        waiting = asyncio.create_task(_post(srv.url + COMPLETIONS, {**long, "n": 3}))
        await asyncio.sleep(0.2)  # 3 sequences wait
        status, payload, headers = await _post(srv.url + COMPLETIONS, {**long, "n": 2})
        assert status == 503 and headers["Retry-After"] == "1"
        assert "3 sequences" in _error(payload, code="overloaded")["message"]
        status, _, _ = await _post(srv.url + COMPLETIONS, {**long, "max_tokens": 1})  # 3 + 1 fits
        assert status == 200
        assert (await running)[0] == 200 and (await waiting)[0] == 200
        # An empty queue takes any n, even one above the bound.
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**long, "max_tokens": 2, "n": 6})
        assert status == 200 and len(payload["choices"]) == 6
    finally:
        await srv.stop()


async def test_503_while_loading_says_retry_after(tokenizer):
    gate = threading.Event()
    srv = await InProcessServer(lambda: FakeCore(tokenizer, load_gate=gate), ["tiny"]).start(
        wait_loaded=False
    )
    try:
        status, payload, headers = await _post(srv.url + COMPLETIONS, {"prompt": "hi"})
        assert status == 503 and headers["Retry-After"] == "1"
        _error(payload, code="not_ready")
    finally:
        gate.set()
        await srv.stop()


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


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_a_huge_prompt_is_refused_before_tokenising(tokenizer, kind):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_model_len=64), ["tiny"], max_body_bytes=8 << 20
    ).start()
    try:
        text = "word " * 800_000  # 4 MB
        if kind == "chat":
            path, body = CHAT, {"messages": [{"role": "user", "content": text}]}
        else:
            path, body = COMPLETIONS, {"prompt": text}
        request = asyncio.create_task(_post(srv.url + path, {"model": "tiny", **body}))
        worst = await _max_health_latency(srv.url, request)
        status, payload, _ = await request
        assert status == 400
        message = _error(payload, code="context_length_exceeded")["message"]
        assert "4000000 characters" in message
        assert worst < 0.5
        status, _, _ = await _post(srv.url + COMPLETIONS, {"prompt": "hello", "max_tokens": 2})
        assert status == 200
    finally:
        await srv.stop()


class SlowTokenizer:
    """A tokenizer that takes 1 s per call and records the threads it ran on."""

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
        time.sleep(1.0)
        return self._inner(*args, **kwargs)


async def test_tokenising_runs_off_the_event_loop(tokenizer):
    SlowTokenizer.threads.clear()
    srv = await InProcessServer(
        lambda: FakeCore(SlowTokenizer(tokenizer), max_model_len=64), ["tiny"]
    ).start()
    try:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
        request = asyncio.create_task(_post(srv.url + COMPLETIONS, body))
        worst = await _max_health_latency(srv.url, request)
        assert (await request)[0] == 200
        assert worst < 0.5  # the 1 s tokenisation did not hold /health up
        assert SlowTokenizer.threads and all(
            name.startswith("engine-prompts") for name in SlowTokenizer.threads
        )
    finally:
        await srv.stop()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": None, "content": "hi"}]}, "messages[0].role"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ],
)
async def test_type_confusion_is_400(tokenizer, path, body, param):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"]).start()
    try:
        status, payload, _ = await _post(srv.url + path, {"model": "tiny", **body})
        assert status == 400, payload
        _error(payload, param=param)
        message = payload["error"]["message"]
        assert len(message) < 300
        status, _, _ = await _post(srv.url + COMPLETIONS, {"prompt": "hello", "max_tokens": 2})
        assert status == 200
    finally:
        await srv.stop()
