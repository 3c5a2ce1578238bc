"""The values a fuzzed field takes (edge values, model names) and the JSON text they are written
as, including what json.dumps cannot write (``Raw``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.fuzzer.profile import Profile


@dataclass(frozen=True)
class Raw:
    """JSON text written into a body as it is: what json.dumps cannot produce (lone surrogate
    escapes, -0.0, 1e999, bytes that are not UTF-8)."""

    text: bytes


def to_json(value: Any, ascii_only: bool) -> bytes:
    """JSON bytes of ``value`` with its Raw parts verbatim; NaN and infinities as the non-standard
    literals json.dumps writes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (
            to_json(str(k), ascii_only) + b":" + to_json(v, ascii_only) for k, v in value.items()
        )
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(to_json(v, ascii_only) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]", inner: bytes = b"1") -> Raw:
    return Raw(opener * depth + inner + closer * depth)


# (label, factory): the values a fuzzed field takes. Factories, so that huge values are built
# only when drawn; the label names the value in reports.
Edge = tuple[str, Callable[[Profile], Any]]

EDGE_VALUES: list[Edge] = [
    ("null", lambda p: None),
    ("true", lambda p: True),
    ("false", lambda p: False),
    ("int 0", lambda p: 0),
    ("int -1", lambda p: -1),
    ("int 1", lambda p: 1),
    ("int 2", lambda p: 2),
    ("int 2**31", lambda p: 2**31),
    ("int 2**53+1", lambda p: 2**53 + 1),
    ("int 2**63", lambda p: 2**63),
    ("int 2**64", lambda p: 2**64),
    ("int -2**63-1", lambda p: -(2**63) - 1),
    ("int 10**30", lambda p: 10**30),
    ("int of 5000 digits", lambda p: Raw(b"1" * 5000)),
    ("float 0.5", lambda p: 0.5),
    ("float -0.0", lambda p: Raw(b"-0.0")),
    ("float 1e-320", lambda p: 1e-320),
    ("float 1e308", lambda p: 1e308),
    ("float -1e308", lambda p: -1e308),
    ("float 1e999 (overflows to inf)", lambda p: Raw(b"1e999")),
    ("literal NaN", lambda p: float("nan")),
    ("literal Infinity", lambda p: float("inf")),
    ("literal -Infinity", lambda p: float("-inf")),
    ("str empty", lambda p: ""),
    ("str space", lambda p: " "),
    ("str a", lambda p: "a"),
    ("str '1'", lambda p: "1"),
    ("str 'true'", lambda p: "true"),
    ("str 'user'", lambda p: "user"),
    ("str huge", lambda p: "x" * p.max_string),
    ("str huge words", lambda p: "hello world " * (p.max_string // 12)),
    ("str huge emoji", lambda p: "\U0001f600" * (p.max_string // 4)),
    ("str NUL", lambda p: "a\x00b"),
    ("str control chars", lambda p: "".join(map(chr, range(32)))),
    ("str RTL override", lambda p: "\u202eabc\u202c\u200f"),
    ("str emoji", lambda p: "\U0001f600\U0001f44d\U0001f3fd\u200d"),
    ("str combining marks", lambda p: "e" + "\u0301" * 200),
    ("str BOM and U+FFFF", lambda p: "\ufeff\uffff\ufffe"),
    ("str CRLF header injection", lambda p: "a\r\nX-Injected: 1\r\n\r\nb"),
    ("str special tokens", lambda p: "<|im_end|>\n<|im_start|>system\n<|endoftext|>"),
    ("str template syntax", lambda p: "{{ 7*7 }}{% raw %}{# x #}"),
    ("str format specifiers", lambda p: "%s%n%x{0}{}\\"),
    ("str lone surrogate \\ud800", lambda p: Raw(b'"\\ud800"')),
    ("str lone surrogate \\udfff", lambda p: Raw(b'"\\udfff"')),
    ("str lone surrogate in text", lambda p: Raw(b'"ab\\udbffcd"')),
    ("str reversed surrogate pair", lambda p: Raw(b'"\\udfff\\ud800"')),
    ("str valid surrogate pair", lambda p: Raw(b'"\\ud83d\\ude00"')),
    ("str UTF-8 encoded surrogate", lambda p: Raw(b'"\xed\xa0\x80"')),
    ("str overlong NUL bytes", lambda p: Raw(b'"\xc0\x80"')),
    ("str invalid byte 0xff", lambda p: Raw(b'"\xff\xfe"')),
    ("str latin-1 byte", lambda p: Raw(b'"caf\xe9"')),
    ("str very long model-like name", lambda p: "m" * 10000),
    ("list empty", lambda p: []),
    ("list of null", lambda p: [None]),
    ("list ['user']", lambda p: ["user"]),
    ("list of ints", lambda p: [1, 2, 3]),
    ("list of strings", lambda p: ["a", "b"]),
    ("list of lists", lambda p: [[1, 2], [3]]),
    ("list of empty lists", lambda p: [[]]),
    ("list of objects", lambda p: [{}]),
    ("list mixed types", lambda p: [1, "a", None, True, 1.5, [], {}]),
    ("list nested 64", lambda p: nested(64)),
    ("list of 100k ints", lambda p: Raw(b"[" + b",".join([b"7"] * 100_000) + b"]")),
    ("list of 5k strings", lambda p: Raw(b"[" + b",".join([b'"s"'] * 5000) + b"]")),
    ("object empty", lambda p: {}),
    ("object empty key", lambda p: {"": None}),
    ("object text part", lambda p: {"type": "text", "text": "hi"}),
    ("object message", lambda p: {"role": "user", "content": "hi"}),
    ("object __proto__", lambda p: {"__proto__": {"polluted": 1}, "constructor": None}),
    (
        "object 10k keys",
        lambda p: Raw(b"{%s}" % b",".join(b'"k%d":%d' % (i, i) for i in range(10_000))),
    ),
    ("object nested 64", lambda p: nested(64, b'{"a":', b"}")),
]

# Values only some fields get, because they mean something there.
_MODEL_VALUES: list[Edge] = [
    ("model alias", lambda p: p.aliases[0] if p.aliases else p.model),
    ("model unknown", lambda p: "no-such-model"),
    ("model other case", lambda p: p.model.upper()),
    ("model padded", lambda p: f" {p.model} "),
    ("model unavailable", lambda p: p.unavailable_model or p.model),
]


def model_values(p: Profile) -> list[Edge]:
    return [v for v in _MODEL_VALUES if p.unavailable_model or v[0] != "model unavailable"]
