"""Incremental detokenizer on a real byte-level BPE tokenizer: multi-byte characters split over
tokens, stop strings across token boundaries, hold-back and flush."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.core.sampling_params import SamplingParams
from scripts.tiny_models import build_tokenizer

TOKENIZER = build_tokenizer()
PROMPT = TOKENIZER.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
MIXED_TEXT = "你好，世界！😀 Hello 🎉 天气很好。龍 café 👩‍👩‍👧 done"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def stream(
    ids: list[int], chunk: int = 1, prompt: list[int] = PROMPT, **params: object
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed `ids` in chunks; returns the deltas (flush included unless a stop string matched)."""
    detok = IncrementalDetokenizer(TOKENIZER, prompt, SamplingParams(**params))
    deltas = []
    for start in range(0, len(ids), chunk):
        delta, stop = detok.add(ids[start : start + chunk])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop, detok
    deltas.append(detok.flush())
    return deltas, None, detok


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Cut at the first stop string to appear: the shortest prefix of `text` containing one."""
    for end in range(len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_text_streams_without_replacement_chars(chunk: int) -> None:
    ids = encode(MIXED_TEXT)
    assert TOKENIZER.decode(ids) == MIXED_TEXT
    assert len(ids) > len(MIXED_TEXT) // 2  # emoji and rare characters span several tokens
    deltas, stop, detok = stream(ids, chunk)
    assert stop is None
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == TOKENIZER.decode(ids) == detok.output_text
    if chunk == 1:
        assert "" in deltas[:-1]  # some tokens ended inside a character and were held back


def test_unfinished_character_is_released_by_flush() -> None:
    ids = encode("天气 😀")[:-2]  # cut inside the emoji's 4 bytes
    deltas, _, _ = stream(ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas[:-1])
    assert deltas[-1].endswith(REPLACEMENT_CHAR)  # the flush
    assert "".join(deltas) == TOKENIZER.decode(ids)


def test_prompt_ending_inside_a_character() -> None:
    ids = encode("你好，世界。今天")
    split = next(i for i in range(1, len(ids)) if TOKENIZER.decode(ids[:i]).endswith("\ufffd"))
    deltas, _, _ = stream(ids[split:], prompt=ids[:split])
    assert "".join(deltas) == TOKENIZER.decode(ids[split:])


def test_special_tokens_add_no_text() -> None:
    ids = [*encode("Hello"), TOKENIZER.eos_token_id]
    deltas, _, _ = stream(ids)
    assert "".join(deltas) == "Hello"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Hello, world! How are you today?", "world! How"),  # spans three tokens
        ("The quick brown fox jumps", "n fo"),  # starts mid-token, ends mid-token
        ("你好，世界。今天天气很好。", "世界"),  # 界's bytes are split over two tokens
        ("ok 👩‍👩‍👧 done", "👧 d"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(text: str, stop: str, include: bool) -> None:
    ids = encode(text)
    assert not any(stop in TOKENIZER.decode([i]) for i in ids)  # really split across tokens
    deltas, matched, detok = stream(ids, stop=[stop], include_stop_str_in_output=include)
    assert matched == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == detok.output_text == text[:cut]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    # Detected on the token that completes it, not later.
    assert TOKENIZER.decode(ids[: len(deltas)]).find(stop) >= 0
    assert TOKENIZER.decode(ids[: len(deltas) - 1]).find(stop) < 0
    assert detok.add(encode(" more")) == ("", None)  # finished: nothing more comes out


def test_possible_stop_prefix_is_held_then_released_by_flush() -> None:
    ids = encode("Hello, wor")
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, SamplingParams(stop=["world!"]))
    emitted = "".join(detok.add([i])[0] for i in ids)
    assert emitted == "Hello, "  # "wor" could still become "world!"
    assert detok.flush() == "wor"
    assert detok.output_text == "Hello, wor"
    assert detok.stop_str is None


def test_held_prefix_is_released_when_ruled_out() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, SamplingParams(stop=["world!"]))
    assert "".join(detok.add([i])[0] for i in encode("Hello, world")) == "Hello, "
    delta, stop = detok.add(encode("?"))
    assert (delta, stop) == ("world?", None)


@pytest.mark.parametrize("chunk", [1, 100])
def test_first_stop_to_appear_wins(chunk: int) -> None:
    ids = encode("Hello, world! How are you today?")
    for stops in (["you", "world"], ["world", "you"], ["How are", "d! H"], ["world! How", "! H"]):
        deltas, matched, _ = stream(ids, chunk, stop=stops)
        expected_text, expected_stop = reference_stop(TOKENIZER.decode(ids), stops, False)
        assert (matched, "".join(deltas)) == (expected_stop, expected_text)
    assert stream(ids, chunk, stop=["you", "world"])[1] == "world"
    assert stream(ids, chunk, stop=["How are", "d! H"])[1] == "d! H"
    # "! H" is complete before "world! How" is, even when both arrive in one step.
    deltas, matched, _ = stream(ids, chunk, stop=["world! How", "! H"])
    assert ("".join(deltas), matched) == ("Hello, world", "! H")


def test_decoding_work_per_token_is_bounded() -> None:
    """Each step decodes a short window, not the whole output (O(1) amortised per token)."""

    class CountingTokenizer:
        decoded_tokens = 0

        def decode(self, ids: list[int], **kwargs: object) -> str:
            CountingTokenizer.decoded_tokens += len(ids)
            return TOKENIZER.decode(ids, **kwargs)

    ids = encode(MIXED_TEXT * 20)
    detok = IncrementalDetokenizer(CountingTokenizer(), PROMPT, SamplingParams(stop=["xyz"]))
    text = "".join(detok.add([i])[0] for i in ids) + detok.flush()
    assert text == TOKENIZER.decode(ids)
    assert CountingTokenizer.decoded_tokens < 12 * len(ids)


PIECES = ["你好", "世界", "😀", "🎉", " Hello", " world", "!", "天气", "a", "b", " ", "é", "\n"]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12),
    stop_spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3),
    extra_stops=st.lists(st.sampled_from(["zz", "界😀", "o w", "!\n"]), max_size=2),
    chunk=st.integers(1, 4),
    include=st.booleans(),
)
def test_matches_reference_for_any_text_stops_and_chunking(
    pieces: list[str],
    stop_spans: list[tuple[int, int]],
    extra_stops: list[str],
    chunk: int,
    include: bool,
) -> None:
    text = "".join(pieces)
    ids = encode(text)
    stops = [text[a : a + n] for a, n in stop_spans if text[a : a + n]] + extra_stops
    deltas, matched, detok = stream(ids, chunk, stop=stops, include_stop_str_in_output=include)
    expected_text, expected_stop = reference_stop(TOKENIZER.decode(ids), stops, include)
    assert matched == expected_stop
    assert "".join(deltas) == detok.output_text == expected_text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
