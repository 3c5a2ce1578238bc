"""Tool calls over HTTP, read by the official OpenAI SDK: a scripted core "generates" a fixed
reply per choice, token by token, so the server's splitting of content and calls is checked
exactly (streamed and not, n > 1, logprobs), apart from any model."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import openai
import pytest

from engine.core.sequence import CompletionOutput, RequestOutput, TokenLogprob
from tests.engine.server_http import CHAT, post, stream
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(120)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


class _Compiled:
    """A ticket whose grammar has compiled."""

    def __init__(self, constraint: Any) -> None:
        self.future: Future = Future()
        self.future.set_result(constraint)

    def release(self) -> None:
        pass


class _AcceptingCompiler:
    """The engine.structured compiler's face the server uses: every constraint compiles (the
    scripted replies follow it)."""

    def request(self, constraint: Any) -> _Compiled:
        return _Compiled(constraint)

    def shutdown(self) -> None:
        pass


class ScriptedCore(FakeCore):
    """Generates ``replies[i]`` as choice i, one token per step, then stops; records each
    request's sampling parameters."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        super().__init__(tokenizer, max_model_len=1024)
        self.replies = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies]
        self.params: list[Any] = []
        self.grammars = _AcceptingCompiler()

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None) -> None:
        super().add_request(request_id, prompt_token_ids, params, arrival_time)
        self.params.append(params)

    def step(self) -> list[RequestOutput]:
        self._running += self._waiting
        self._waiting = []
        outputs = []
        for req in list(self._running):
            step = req.generated
            req.generated += 1
            choices = []
            for i in range(req.params.n):
                reply = self.replies[i % len(self.replies)]
                if step >= len(reply):
                    continue
                token = reply[step]
                logprobs = (
                    [TokenLogprob(token, -0.5, [])] if req.params.logprobs is not None else None
                )
                done = "stop" if step == len(reply) - 1 else None
                text = self.tokenizer.decode([token])
                choices.append(CompletionOutput(i, [token], text, logprobs, done))
            finished = all(
                req.generated >= len(self.replies[i % len(self.replies)])
                for i in range(req.params.n)
            )
            if finished:
                self._running.remove(req)
            outputs.append(RequestOutput(req.request_id, choices, finished, len(req.prompt)))
        return outputs


@pytest.fixture
async def scripted(request, tokenizer):
    """A server whose core generates the test's ``replies`` (pytest.mark.parametrize indirect)."""
    core = ScriptedCore(tokenizer, request.param)
    srv = await InProcessServer(lambda: core, ["tiny"]).start()
    srv.core = core
    yield srv
    await srv.stop()


def _client(srv: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("scripted", [[HERMES]], indirect=True)
async def test_auto_call_non_streamed(scripted):
    reply = await _client(scripted).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=200
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert scripted.core.params[-1].structured is None  # auto: nothing forced


@pytest.mark.parametrize("scripted", [[HERMES]], indirect=True)
@pytest.mark.parametrize("strict", [False, True])  # strict: the SDK parses the arguments too
async def test_auto_call_streamed_through_the_sdk(scripted, strict):
    client = _client(scripted)
    tool = {**WEATHER, "function": {**WEATHER["function"], "strict": strict}}
    async with client.chat.completions.stream(
        model="tiny", messages=MESSAGES, tools=[tool], max_tokens=200
    ) as events:
        final = await events.get_final_completion()
    choice = final.choices[0]
    if strict:
        assert choice.message.tool_calls[0].function.parsed_arguments == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("scripted", [[HERMES]], indirect=True)
async def test_streamed_chunks_hold_back_tags_and_open_each_call_once(scripted):
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "stream": True}
    events = await stream(scripted.url + CHAT, body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking." and all("<" not in (d.get("content") or "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "tool_calls"
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("scripted", [[FORCED]], indirect=True)
async def test_required_sets_the_constraint_and_parses_the_json(scripted):
    for stream_it in (False, True):
        kwargs = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]}
        client = _client(scripted)
        if stream_it:
            async with client.chat.completions.stream(**kwargs, tool_choice="required") as events:
                reply = await events.get_final_completion()
        else:
            reply = await client.chat.completions.create(**kwargs, tool_choice="required")
        constraint = scripted.core.params[-1].structured
        assert constraint is not None and constraint.kind == "json_schema"
        assert json.loads(constraint.value)["type"] == "array"
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("scripted", [[HERMES, "No tools needed."]], indirect=True)
async def test_each_choice_is_split_on_its_own(scripted):
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "n": 2}
    status, reply = await post(scripted.url + CHAT, body)
    assert status == 200, reply
    first, second = reply["choices"]
    assert first["finish_reason"] == "tool_calls" and len(first["message"]["tool_calls"]) == 1
    assert second["finish_reason"] == "stop" and "tool_calls" not in second["message"]
    assert second["message"]["content"] == "No tools needed."
    events = await stream(scripted.url + CHAT, {**body, "stream": True})
    finish = {
        e["choices"][0]["index"]: e["choices"][0]["finish_reason"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["finish_reason"]
    }
    assert finish == {0: "tool_calls", 1: "stop"}
    calls = [e["choices"][0] for e in events[:-1] if e["choices"][0]["delta"].get("tool_calls")]
    assert {c["index"] for c in calls} == {0}


@pytest.mark.parametrize("scripted", [[HERMES]], indirect=True)
async def test_streamed_logprobs_cover_every_token_held_back_or_not(scripted):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": [WEATHER],
        "stream": True,
        "logprobs": True,
    }
    events = await stream(scripted.url + CHAT, body)
    tokens = sum(
        len(e["choices"][0]["logprobs"]["content"])
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["logprobs"]
    )
    assert tokens == len(scripted.core.replies[0])


@pytest.mark.parametrize("scripted", [[HERMES]], indirect=True)
async def test_tool_choice_none_leaves_the_reply_as_text(scripted):
    status, reply = await post(
        scripted.url + CHAT,
        {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"},
    )
    assert status == 200 and reply["choices"][0]["message"]["content"] == HERMES
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("scripted", [["unused"]], indirect=True)
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)
async def test_bad_tool_fields_are_openai_400s(scripted, fields, param):
    status, reply = await post(
        scripted.url + CHAT, {"model": "tiny", "messages": MESSAGES, **fields}
    )
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
