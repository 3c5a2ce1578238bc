"""Tools in the prompt: messages with tool calls and results parse; a template that renders
tools gets them as transformers passes them; one that ignores them (SmolLM2's) gets the Hermes
fallback; one that cannot show them is a 400."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.errors import InvalidRequestError
from engine.serving.prompts import apply_chat_template, parse_messages, prompt_chars
from engine.serving.tools.rendering import template_renders_tools
from scripts.tiny_models import CHAT_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ARGUMENTS = '{"city": "Paris"}'
LOOP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGUMENTS},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
]
# A tool-aware template in the style of Qwen2.5's: it writes the tools and calls itself.
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments.city }}|{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _tokenizer(template: str) -> Any:
    from scripts.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str:
    ids = apply_chat_template(tokenizer, parse_messages(messages), True, tools)
    return tokenizer.decode(ids)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    return AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, local_files_only=True
    )


@pytest.mark.smollm2
def test_smollm2_gets_the_hermes_fallback(smollm2_tokenizer):
    assert not template_renders_tools(smollm2_tokenizer)  # its template ignores tools
    prompt = _render(smollm2_tokenizer, LOOP, [WEATHER])
    system = "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    assert prompt.startswith(system), prompt
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>\n<tool_call>\n'
    ) in prompt
    # Both results in one user turn, as Qwen2.5's template writes them.
    assert (
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n"
        "<tool_response>\n25 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_smollm2_without_tools_is_unchanged(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    reference = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert _render(smollm2_tokenizer, messages, None) == reference


def test_without_a_system_message_the_tools_get_one():
    prompt = _render(_tokenizer(CHAT_TEMPLATE), LOOP[1:2], [WEATHER])
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>" in prompt


def test_an_earlier_call_beside_text_and_without_tools_uses_the_fallback_too():
    messages = copy.deepcopy(LOOP[1:4])
    messages[1]["content"] = "Checking."
    prompt = _render(_tokenizer(CHAT_TEMPLATE), messages, None)
    assert "# Tools" not in prompt
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in prompt


def test_a_tool_aware_template_gets_the_tools_as_transformers_passes_them():
    tokenizer = _tokenizer(NATIVE_TEMPLATE)
    assert template_renders_tools(tokenizer)
    prompt = _render(tokenizer, LOOP, [WEATHER])
    # The reference: transformers itself, with the arguments as objects (its convention).
    messages = copy.deepcopy(LOOP)
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    messages[4]["content"] = "25 C"
    reference = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert prompt == reference
    assert prompt.startswith("TOOLS:get_weather;[system]") and "CALL get_weather Paris|" in prompt


def test_a_template_that_drops_the_system_message_cannot_show_tools():
    tokenizer = _tokenizer(
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(InvalidRequestError) as raised:
        _render(tokenizer, LOOP[1:2], [WEATHER])
    assert raised.value.message == "tools are not supported by this model's chat template"
    assert raised.value.param == "tools"


def test_a_template_that_refuses_the_conversation_is_a_400():
    tokenizer = _tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError) as raised:
        _render(tokenizer, LOOP[1:2], [WEATHER])
    assert raised.value.param == "messages" and "roles must alternate" in raised.value.message


def test_prompt_chars_count_calls_and_tools():
    messages = parse_messages(LOOP)
    texts = len("Be brief.") + len("Weather in Paris and Rome?") + len("22 C") + len("25 C")
    calls = 2 * len("get_weather") + len(ARGUMENTS) + len('{"city": "Rome"}')
    assert prompt_chars(messages, None) == texts + calls
    assert prompt_chars(messages, [WEATHER]) == texts + calls + len(json.dumps([WEATHER]))


def _call(**fields: Any) -> dict:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return {"role": "assistant", "content": None, "tool_calls": [{**call, **fields}]}


BAD_MESSAGES = [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c"}, "messages[0].content"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None}, "messages[0].content"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [5]}, "messages[0].tool_calls[0]"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
    (_call(type="code"), "messages[0].tool_calls[0].type"),
    (_call(id=None), "messages[0].tool_calls[0].id"),
    (_call(function="f"), "messages[0].tool_calls[0].function"),
    (_call(function={"name": "f"}), "messages[0].tool_calls[0].function.arguments"),
    (
        _call(function={"name": "f", "arguments": {}}),
        "messages[0].tool_calls[0].function.arguments",
    ),
    (_call(function={"arguments": "{}"}), "messages[0].tool_calls[0].function.name"),
]


@pytest.mark.parametrize(("message", "param"), BAD_MESSAGES)
def test_bad_tool_messages_are_400_naming_the_path(message, param):
    with pytest.raises(InvalidRequestError) as raised:
        parse_messages([message])
    assert raised.value.param == param, raised.value.message


def test_tool_messages_parse():
    messages = parse_messages(LOOP)
    assert messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": LOOP[2]["tool_calls"],
    }
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}
    assert messages[4]["content"] == "25 C"
