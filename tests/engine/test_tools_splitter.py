"""Tool calls out of generated text: Hermes blocks (tool_choice auto) and the forced call's JSON
(required / named), whole and streamed in every chunking; a stream's pieces must add up to the
whole reply's content and calls, and never show a partial tag as content."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.serving.tools.request import ToolRequest, parse_tool_request
from engine.serving.tools.splitter import CallPiece, ContentPiece, new_splitter, split_reply

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _request(tool_choice: Any = "auto", parallel: bool = True) -> ToolRequest:
    request = parse_tool_request(
        {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    )
    assert request is not None
    return request


def _block(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _streamed(request: ToolRequest, chunks: list[str]) -> tuple[str | None, list[dict]]:
    """A stream's pieces added up as the OpenAI SDK does: content concatenated, each call's
    first piece opening it and later pieces extending its arguments."""
    splitter = new_splitter(request)
    assert splitter is not None
    pieces = [piece for chunk in chunks for piece in splitter.feed(chunk)] + splitter.finish()
    content = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    calls: list[dict] = []
    for piece in pieces:
        assert isinstance(piece, CallPiece | ContentPiece)
        if isinstance(piece, CallPiece):
            if piece.id is not None:
                assert piece.index == len(calls) and re.fullmatch(r"call_[A-Za-z0-9]{24}", piece.id)
                calls.append({"name": piece.name, "arguments": piece.arguments})
            else:
                assert piece.name is None and piece.index < len(calls)
                calls[piece.index]["arguments"] += piece.arguments
    return content or None, calls


def _plain(calls: list[dict]) -> list[dict]:
    """Calls without their random ids: name and parsed arguments."""
    return [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in calls
    ]


def _chunkings(text: str) -> list[list[str]]:
    return [[text], list(text), [text[i : i + 3] for i in range(0, len(text), 3)]]


# ---- auto: Hermes blocks ---------------------------------------------------------------------


def test_hermes_calls_and_the_content_around_them():
    text = (
        "Let me check both.\n"
        + _block("get_weather", {"city": "Paris"})
        + "\n"
        + _block("get_time", {})
        + "\n"
    )
    content, calls = split_reply(_request(), text)
    assert content == "Let me check both."
    assert _plain(calls) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_only_calls_means_no_content():
    content, calls = split_reply(_request(), _block("get_time", {}))
    assert content is None and len(calls) == 1


def test_a_reply_without_calls_is_its_text_exactly():
    for text in ["  Hello.\n\n", "a < b, and <tool is not a tag\n", "<tool_cal", ""]:
        assert split_reply(_request(), text) == (text or None, [])
        assert _streamed(_request(), list(text)) == (text or None, [])


def test_a_block_that_is_not_a_call_stays_content():
    for block in [
        "<tool_call>{not json}</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>',  # not declared
        '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
    ]:
        text = "Before " + block + " after"
        assert split_reply(_request(), text) == (text, [])
        assert _streamed(_request(), list(text)) == (text, [])


def test_an_unclosed_block_is_a_call_if_it_parses():
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {}}'
    content, calls = split_reply(_request(), text)
    assert content == "Sure." and _plain(calls) == [{"name": "get_time", "arguments": {}}]
    cut = 'Sure. <tool_call>{"name": "get_ti'  # cut short (max_tokens): the text as it was
    assert split_reply(_request(), cut) == (cut, [])


def test_a_streamed_partial_tag_is_held_back():
    splitter = new_splitter(_request())
    assert splitter.feed("Hi <tool") == [ContentPiece("Hi")]  # the space is held too
    assert splitter.feed("_c") == []
    pieces = splitter.feed('all>{"name": "get_time", "arguments": {}}</tool_call>')
    assert len(pieces) == 1 and isinstance(pieces[0], CallPiece) and pieces[0].name == "get_time"
    assert splitter.feed(" <b>") == [ContentPiece("  <b>")]  # the held space comes too
    assert splitter.finish() == []


def test_a_held_back_prefix_that_is_no_tag_is_content():
    splitter = new_splitter(_request())
    assert splitter.feed("x <tool") == [ContentPiece("x")]
    assert splitter.feed("box") == [ContentPiece(" <toolbox")]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=20))
def test_hermes_stream_adds_up_to_the_whole_reply_in_any_chunking(cuts):
    text = (
        "I will call. "
        + _block("get_weather", {"city": "Zürich <x>"})
        + " then "
        + "<tool_call>{broken}</tool_call>"
        + _block("get_time", {})
    )
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    content, calls = split_reply(_request(), text)
    streamed_content, streamed_calls = _streamed(_request(), chunks)
    assert streamed_content == content == "I will call.  then <tool_call>{broken}</tool_call>"
    assert [
        {"name": c["name"], "arguments": json.loads(c["arguments"])} for c in streamed_calls
    ] == (_plain(calls))


# ---- required / named: the forced call's JSON ------------------------------------------------


def test_required_calls_stream_their_arguments_in_pieces():
    text = json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": "Paris", "extra": [1, {"a": "}"}]}},
            {"name": "get_time", "arguments": {}},
        ]
    )
    content, calls = split_reply(_request("required"), text)
    assert content is None
    assert _plain(calls) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "extra": [1, {"a": "}"}]}},
        {"name": "get_time", "arguments": {}},
    ]
    splitter = new_splitter(_request("required"))
    pieces = [piece for char in text for piece in splitter.feed(char)] + splitter.finish()
    assert sum(1 for p in pieces if p.index == 0) > 5  # arguments sent as they were generated
    for chunks in _chunkings(text):
        streamed_content, streamed = _streamed(_request("required"), chunks)
        assert streamed_content is None
        # The stream's arguments are the generated text itself, the whole reply's too.
        assert [c["arguments"] for c in streamed] == [c["function"]["arguments"] for c in calls]


def test_arguments_generated_before_the_name_wait_for_it():
    # The schema's keys sorted: a decoder following them writes arguments first.
    text = '[{"arguments": {"city": "Oslo"}, "name": "get_weather"}]'
    splitter = new_splitter(_request("required"))
    before_name = text.index('"name"')
    assert all(splitter.feed(char) == [] for char in text[:before_name])
    for chunks in _chunkings(text):
        content, calls = _streamed(_request("required"), chunks)
        assert content is None
        assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    content, whole = split_reply(_request("required"), text)
    assert _plain(whole) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]


def test_named_is_one_object():
    text = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    content, calls = split_reply(_request(NAMED), text)
    assert content is None and _plain(calls) == [
        {"name": "get_weather", "arguments": {"city": "Rome"}}
    ]
    assert _streamed(_request(NAMED), list(text))[1][0]["arguments"] == '{"city": "Rome"}'


def test_whitespace_around_the_json_is_not_in_the_arguments():
    text = ' [ { "name" : "get_time" , "arguments" : { } } ] '
    content, calls = split_reply(_request("required"), text)
    assert content is None and [c["function"]["arguments"] for c in calls] == ["{ }"]
    assert _streamed(_request("required"), list(text))[1][0]["arguments"] == "{ }"


def test_a_forced_reply_that_is_not_the_json_is_content():
    # What a model writes when the engine does not enforce the constraint.
    for text in ["Sure, the weather in Paris is", '{"name": "get_time"}']:
        assert split_reply(_request("required"), text) == (text, [])
    assert _streamed(_request("required"), list("Sure!")) == ("Sure!", [])


def test_a_forced_reply_cut_short_is_content_whole_and_partial_calls_streamed():
    text = '[{"name": "get_weather", "arguments": {"city": "Par'
    assert split_reply(_request("required"), text) == (text, [])
    content, calls = _streamed(_request("required"), list(text))
    assert content is None and calls == [{"name": "get_weather", "arguments": '{"city": "Par'}]


def test_an_undeclared_name_invalidates_a_whole_forced_reply():
    for text in ['[{"name": "get_news", "arguments": {}}]', '[{"name": {}, "arguments": {}}]']:
        assert split_reply(_request("required"), text) == (text, [])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list('<>/tool_call{}[]":, \\namegt_wiharuy0')), max_size=80
    ),
    mode=st.sampled_from(["auto", "required", NAMED]),
)
def test_any_text_splits_without_error_and_streams_as_it_splits_whole(text, mode):
    content, calls = split_reply(_request(mode), text)
    if mode == "auto":  # auto streams exactly what the whole reply holds
        streamed_content, streamed = _streamed(_request(mode), list(text))
        assert streamed_content == content
        assert streamed == [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
    elif not calls:  # a forced reply that is not the JSON is its text as it is
        assert content == (text or None)


def test_tool_choice_none_parses_nothing():
    text = _block("get_time", {})
    assert new_splitter(_request("none")) is None
    assert split_reply(_request("none"), text) == (text, [])
    assert split_reply(None, "") == ("", [])  # no tools: the reply unchanged, even empty
