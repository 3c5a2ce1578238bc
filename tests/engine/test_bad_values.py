"""Every bad value of every field is a 400 naming the field, client strings quoted only in
part."""

from __future__ import annotations

from typing import Any

import pytest

from engine.serving.requests import RequestLimits, parse_completion_request
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
    (*_role("tool"), "messages[0].tool_call_id"),
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
    (*_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (*_chat(logit_bias={"1": 5}), "logit_bias"),
    (*_chat(response_format={"type": "xml"}), "response_format"),
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
    status, payload, _ = await post(server.url + path, body)
    assert status == 400, payload
    error = openai_error(payload)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (param or "messages[0].tool_calls")
    assert len(error["message"]) < 400, error  # client strings are quoted only in part
    await assert_still_serves(server)


async def test_a_long_unknown_model_name_is_quoted_cut_short(server):
    name = "m" * 1_000_000
    status, payload, _ = await post(server.url + CHAT, {"model": name, "messages": MSG})
    assert status == 404
    message = openai_error(payload, code="model_not_found", param="model")["message"]
    assert len(message) < 200 and "…" in message
    await assert_still_serves(server)


def test_stop_token_ids_are_deduplicated():
    limits = RequestLimits(max_model_len=64, max_n=4, vocab_size=512, longest_token_chars=8)
    body = {"prompt": "hi", "stop_token_ids": [7, 3] * 50_000}
    assert parse_completion_request(body, limits).params.stop_token_ids == [7, 3]
