"""The engine against hostile requests: bounded n, choices counted in the queue bound, prompts
templated and tokenised off the event loop with a size cap before that work, every bad field a 400
naming it, 503s that say when to come back, client strings quoted only in part."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import aiohttp
import pytest

from engine.errors import InvalidRequestError
from engine.serving.requests import RequestLimits, longest_token_chars, parse_completion_request
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer
from tests.tiny_models import build_tokenizer

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
VALID = {"prompt": "hello", "max_tokens": 2}


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


async def _assert_still_serves(srv: InProcessServer) -> None:
    status, payload, _ = await _post(srv.url + COMPLETIONS, VALID)
    assert status == 200, payload


# ---- n and the queue bound -------------------------------------------------------------------


async def test_n_above_the_cap_is_400(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"], max_queue=1024).start()
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": 10_000}
        status, payload, _ = await _post(srv.url + COMPLETIONS, body)
        assert status == 400
        assert "128" in _error(payload, param="n")["message"]
        assert srv.engine.num_waiting == 0  # refused before it took any place
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**body, "n": 128})
        assert status == 200 and len(payload["choices"]) == 128
        assert {c["finish_reason"] for c in payload["choices"]} == {"length"}
    finally:
        await srv.stop()


async def test_n_above_what_the_queue_holds_is_400_not_a_wait(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"], max_queue=4).start()
    try:
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**VALID, "n": 5})
        assert status == 400
        assert "between 1 and 4" in _error(payload, param="n")["message"]
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**VALID, "n": 4})
        assert status == 200 and len(payload["choices"]) == 4
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
        await asyncio.sleep(0.2)  # 3 sequences wait in the core
        assert srv.engine.num_waiting == 3
        status, payload, headers = await _post(srv.url + COMPLETIONS, {**long, "n": 2})
        assert status == 503 and headers["Retry-After"] == "1"
        assert "3 sequences" in _error(payload, code="overloaded")["message"]
        status, _, _ = await _post(srv.url + COMPLETIONS, {**long, "max_tokens": 1})  # 3 + 1 fits
        assert status == 200
        assert (await running)[0] == 200 and (await waiting)[0] == 200
    finally:
        await srv.stop()


async def test_choices_on_their_way_to_the_core_count_too(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, step_delay=1.0), ["tiny"], max_queue=4
    ).start()
    try:
        first = asyncio.create_task(_post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 3}))
        await asyncio.sleep(1.3)  # the core thread is in its second 1 s step: adds wait for it
        pending = asyncio.create_task(_post(srv.url + COMPLETIONS, {**VALID, "n": 3}))
        await asyncio.sleep(0.1)
        assert srv.engine.num_waiting == 3
        status, payload, _ = await _post(srv.url + COMPLETIONS, {**VALID, "n": 2})
        assert status == 503
        _error(payload, code="overloaded")
        assert (await first)[0] == 200 and (await pending)[0] == 200
    finally:
        await srv.stop()


async def test_a_client_gone_aborts_all_its_choices(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_num_seqs=1, step_delay=0.05), ["tiny"], max_queue=64
    ).start()
    try:
        busy = asyncio.create_task(_post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 200}))
        await asyncio.sleep(0.2)
        gone = asyncio.create_task(_post(srv.url + COMPLETIONS, {**VALID, "n": 32}))
        await asyncio.sleep(0.3)
        assert srv.engine.num_waiting == 32
        gone.cancel()  # closes the connection: the handler is cancelled and aborts
        deadline = time.monotonic() + 2.0
        while srv.engine.num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert srv.engine.num_waiting == 0 and srv.engine.num_in_flight == 1
        busy.cancel()
    finally:
        await srv.stop()


# ---- Retry-After -----------------------------------------------------------------------------


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


async def test_503_while_shutting_down_says_retry_after_and_a_dead_loop_does_not(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer, fail_on_step=2), ["tiny"]).start()
    try:
        srv.engine.accepting = False
        status, payload, headers = await _post(srv.url + COMPLETIONS, VALID)
        assert status == 503 and headers["Retry-After"] == "1"
        _error(payload, code="shutting_down")
        srv.engine.accepting = True
        assert (await _post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 5}))[0] == 500
        status, payload, headers = await _post(srv.url + COMPLETIONS, VALID)
        assert status == 503 and "Retry-After" not in headers
        _error(payload, code="engine_dead")
    finally:
        await srv.stop()


# ---- prompts off the event loop, and the size cap --------------------------------------------


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
        request = asyncio.create_task(_post(srv.url + path, {"model": "tiny", **body}))
        worst = await _max_health_latency(srv.url, request)
        status, payload, _ = await request
        assert status == 400
        message = _error(payload, code="context_length_exceeded", param=param)["message"]
        assert "4000000 characters" in message
        assert SlowTokenizer.threads == []  # refused without tokenising
        assert worst < 0.5
        await _assert_still_serves(srv)
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
        request = asyncio.create_task(_post(srv.url + path, {"model": "tiny", **body}))
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
        status, payload, _ = await _post(srv.url + COMPLETIONS, {"prompt": [5] * 500_000})
        assert status == 400
        _error(payload, code="context_length_exceeded", param="prompt")
        await _assert_still_serves(srv)
    finally:
        await srv.stop()


# ---- every bad value is a 400 naming the field -----------------------------------------------

NAN, INF = float("nan"), float("inf")


def _chat(**fields: Any) -> tuple[str, dict]:
    return CHAT, {"messages": MSG, "max_tokens": 2, **fields}


def _completion(**fields: Any) -> tuple[str, dict]:
    return COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **fields}


def _content(content: Any) -> tuple[str, dict]:
    return CHAT, {"messages": [{"role": "user", "content": content}]}


def _role(role: Any) -> tuple[str, dict]:
    return CHAT, {"messages": [{"role": role, "content": "hi"}]}


BAD_VALUES = [
    # chat messages
    (*_role(["user"]), "messages[0].role"),
    (*_role({"a": 1}), "messages[0].role"),
    (*_role(None), "messages[0].role"),
    (*_role(5), "messages[0].role"),
    (*_role("r" * 100_000), "messages[0].role"),
    (*_role("tool"), "messages[0].role"),
    (*_content(5), "messages[0].content"),
    (*_content(None), "messages[0].content"),
    (*_content({"type": "text", "text": "hi"}), "messages[0].content"),
    (*_content([5]), "messages[0].content"),
    (*_content([None]), "messages[0].content"),
    (*_content([["a"]]), "messages[0].content"),
    (*_content([{"type": ["text"], "text": "hi"}]), "messages[0].content"),
    (*_content([{"type": "t" * 100_000}]), "messages[0].content"),
    (*_content([{"type": "text"}]), "messages[0].content"),
    (*_content([{"type": "text", "text": 5}]), "messages[0].content"),
    (*_content([{"type": "image_url", "image_url": {"url": "http://x"}}]), "messages[0].content"),
    (CHAT, {"messages": None}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": {"role": "user", "content": "hi"}}, "messages"),
    (CHAT, {"messages": [5]}, "messages[0]"),
    (CHAT, {"messages": [None]}, "messages[0]"),
    (CHAT, {"messages": [[]]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "", "tool_calls": [{}]}]}, None),
    # fields shared by both endpoints
    (*_chat(model=["tiny"]), "model"),
    (*_chat(model={"a": 1}), "model"),
    (*_chat(model=5), "model"),
    (*_chat(stream="yes"), "stream"),
    (*_chat(stream=1), "stream"),
    (*_chat(stream_options=[]), "stream_options"),
    (*_chat(stream_options={"include_usage": "yes"}), "include_usage"),
    (*_chat(user=5), "user"),
    (*_chat(n=0), "n"),
    (*_chat(n=-1), "n"),
    (*_chat(n=True), "n"),
    (*_chat(n=1.5), "n"),
    (*_chat(n="2"), "n"),
    (*_chat(n=2**70), "n"),
    (*_chat(n=10**30), "n"),
    (*_chat(max_tokens=0), "max_tokens"),
    (*_chat(max_tokens=-5), "max_tokens"),
    (*_chat(max_tokens=10**30), "max_tokens"),
    (*_chat(max_tokens=1.5), "max_tokens"),
    (*_chat(max_tokens="5"), "max_tokens"),
    (*_chat(max_tokens=True), "max_tokens"),
    (*_chat(max_completion_tokens=0), "max_completion_tokens"),
    (*_chat(max_completion_tokens=[1]), "max_completion_tokens"),
    (*_chat(temperature=NAN), "temperature"),
    (*_chat(temperature=INF), "temperature"),
    (*_chat(temperature=-INF), "temperature"),
    (*_chat(temperature=10**400), "temperature"),
    (*_chat(temperature="hot"), "temperature"),
    (*_chat(temperature=[1]), "temperature"),
    (*_chat(temperature={"a": 1}), "temperature"),
    (*_chat(temperature=True), "temperature"),
    (*_chat(temperature=5), "temperature"),
    (*_chat(top_p=0), "top_p"),
    (*_chat(top_p=1.5), "top_p"),
    (*_chat(top_p=NAN), "top_p"),
    (*_chat(top_k=-2), "top_k"),
    (*_chat(top_k=1.5), "top_k"),
    (*_chat(top_k=2**64), "top_k"),
    (*_chat(min_p=-0.1), "min_p"),
    (*_chat(min_p=NAN), "min_p"),
    (*_chat(presence_penalty=3), "presence_penalty"),
    (*_chat(presence_penalty=NAN), "presence_penalty"),
    (*_chat(frequency_penalty=-INF), "frequency_penalty"),
    (*_chat(repetition_penalty=0), "repetition_penalty"),
    (*_chat(repetition_penalty=NAN), "repetition_penalty"),
    (*_chat(seed=2**70), "seed"),
    (*_chat(seed=-(2**70)), "seed"),
    (*_chat(seed=1.5), "seed"),
    (*_chat(seed="1"), "seed"),
    (*_chat(stop=[1, 2]), "stop"),
    (*_chat(stop=[None]), "stop"),
    (*_chat(stop=[""]), "stop"),
    (*_chat(stop=""), "stop"),
    (*_chat(stop=[["a"]]), "stop"),
    (*_chat(stop={"a": 1}), "stop"),
    (*_chat(stop=5), "stop"),
    (*_chat(stop=["a"] * 17), "stop"),
    (*_chat(stop_token_ids=[2**70]), "stop_token_ids"),
    (*_chat(stop_token_ids=[10**6]), "stop_token_ids"),
    (*_chat(stop_token_ids=[-1]), "stop_token_ids"),
    (*_chat(stop_token_ids=[1.5]), "stop_token_ids"),
    (*_chat(stop_token_ids=[True]), "stop_token_ids"),
    (*_chat(stop_token_ids=[[1]]), "stop_token_ids"),
    (*_chat(stop_token_ids="1"), "stop_token_ids"),
    (*_chat(stop_token_ids=5), "stop_token_ids"),
    (*_chat(logprobs=5), "logprobs"),
    (*_chat(logprobs="yes"), "logprobs"),
    (*_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (*_chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (*_chat(logprobs=True, top_logprobs=2**70), "top_logprobs"),
    (*_chat(logprobs=True, top_logprobs=1.5), "top_logprobs"),
    (*_chat(top_logprobs=3), "top_logprobs"),
    (*_chat(ignore_eos="yes"), "ignore_eos"),
    (*_chat(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (*_chat(add_generation_prompt="no"), "add_generation_prompt"),
    (*_chat(tools=[{"type": "function"}]), "tools"),
    (*_chat(logit_bias={"1": 5}), "logit_bias"),
    (*_chat(response_format={"type": "json_object"}), "response_format"),
    (*_chat(response_format={"type": ["text"]}), "response_format"),
    (*_chat(best_of=3), "best_of"),
    (*_chat(best_of="3"), "best_of"),
    # completions
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [""]}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [None]}, "prompt"),
    (COMPLETIONS, {"prompt": [None, 1]}, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": [2**70]}, "prompt"),
    (COMPLETIONS, {"prompt": [10**6]}, "prompt"),
    (COMPLETIONS, {"prompt": [1.5]}, "prompt"),
    (COMPLETIONS, {"prompt": [True, 1]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": [[[1]]]}, "prompt"),
    (COMPLETIONS, {"prompt": {"a": 1}}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": True}, "prompt"),
    (*_completion(logprobs=21), "logprobs"),
    (*_completion(logprobs=-1), "logprobs"),
    (*_completion(logprobs=True), "logprobs"),
    (*_completion(logprobs=1.5), "logprobs"),
    (*_completion(echo=True), "echo"),
    (*_completion(suffix="x"), "suffix"),
    # /tokenize and /detokenize
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "x"}, "add_special_tokens"),
    ("/tokenize", {"messages": MSG, "add_generation_prompt": "x"}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": None}, "messages"),
    ("/tokenize", {"model": ["tiny"], "prompt": "hi"}, "model"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [[1]]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": {"a": 1}}, "tokens"),
]


@pytest.fixture
async def server(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer, max_model_len=64), ["tiny"]).start()
    yield srv
    await srv.stop()


@pytest.mark.parametrize(("path", "body", "param"), BAD_VALUES)
async def test_every_bad_value_is_a_400_naming_it(server, path, body, param):
    status, payload, _ = await _post(server.url + path, body)
    assert status == 400, payload
    error = _error(payload)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (param or "messages[0].tool_calls")
    assert len(error["message"]) < 400, error  # client strings are quoted only in part
    await _assert_still_serves(server)


async def test_a_long_unknown_model_name_is_quoted_cut_short(server):
    name = "m" * 1_000_000
    status, payload, _ = await _post(server.url + CHAT, {"model": name, "messages": MSG})
    assert status == 404
    message = _error(payload, code="model_not_found", param="model")["message"]
    assert len(message) < 200 and "…" in message
    await _assert_still_serves(server)


def test_stop_token_ids_are_deduplicated():
    limits = RequestLimits(max_model_len=64, max_n=4, vocab_size=512, longest_token_chars=8)
    body = {"prompt": "hi", "stop_token_ids": [7, 3] * 50_000}
    assert parse_completion_request(body, limits).params.stop_token_ids == [7, 3]


def test_the_prompt_cap_is_max_model_len_tokens_of_the_longest_token_four_times(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(token) for token in tokenizer.get_vocab())
    limits = RequestLimits(max_model_len=64, max_n=4, vocab_size=512, longest_token_chars=longest)
    assert limits.max_prompt_chars == 64 * longest * 4
    parse_completion_request({"prompt": "x" * limits.max_prompt_chars}, limits)
    with pytest.raises(InvalidRequestError) as refused:
        parse_completion_request({"prompt": "x" * (limits.max_prompt_chars + 1)}, limits)
    assert refused.value.code == "context_length_exceeded"
