"""Family ``json``: the bytes of a valid body broken (truncated, trailing garbage, BOM, NaN
literals, duplicate keys, deep nesting, other top-level types, non-UTF-8, UTF-16/32)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from scripts.fuzzer.bodies import body_paths, valid_bytes
from scripts.fuzzer.profile import Profile
from scripts.fuzzer.request import Case, post
from scripts.fuzzer.values import nested


def _json_truncated(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b[: rng.randrange(len(b))]


def _json_trailing(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b + rng.choice([b"}", b"]", b",", b"x", b"\x00", b' {"a":1}', b"\n\n{", b"\xff", b"//"])


def _json_bom(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice([b"\xef\xbb\xbf", b"\xfe\xff", b"\xff\xfe"]) + b


def _json_nan_literal(rng: random.Random, p: Profile, b: bytes) -> bytes:
    literal = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"undefined"])
    return b[:-1] + b',"temperature":' + literal + b"}"


def _json_duplicate_keys(rng: random.Random, p: Profile, b: bytes) -> bytes:
    # A key the body has: the copy differs in value, and which copy wins decides the request.
    key = json.dumps(rng.choice(sorted(json.loads(b)))).encode()
    value = rng.choice([b"null", b"1", b'"x"', b"[]", b"{}", b"true"])
    if rng.random() < 0.5:
        return b"{" + key + b":" + value + b"," + b[1:]  # the valid value comes last
    return b[:-1] + b"," + key + b":" + value + b"}"  # the odd one comes last


def _json_many_duplicates(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b"{" + b'"model":"x",' * 50_000 + b[1:]


def _json_deep(rng: random.Random, p: Profile, b: bytes) -> bytes:
    depth = rng.choice([100, 129, 1000, 100_000])
    where = rng.choice(["top", "field", "object", "unclosed"])
    if where == "top":
        return nested(depth).text
    if where == "object":
        return nested(depth, b'{"a":', b"}").text
    if where == "unclosed":
        return b[:-1] + b',"messages":' + b"[" * depth
    field = rng.choice([b'"messages"', b'"prompt"', b'"stop"', b'"tools"', b'"metadata"'])
    return b[:-1] + b"," + field + b":" + nested(depth).text + b"}"


def _json_top_level(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice(
        [b"[]", b"[" + b + b"]", b'"hello"', b"123", b"null", b"true", b"1e999", b'""']
    )


def _json_non_utf8(rng: random.Random, p: Profile, b: bytes) -> bytes:
    bad = rng.choice(
        [b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc3"]
    )
    at = b.find(b"Hello")
    at = at + 2 if at >= 0 else rng.randrange(1, len(b))
    return b[:at] + bad + b[at:]


def _json_latin1(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b.replace(b"Hello", "Héllo wörld".encode("latin-1"))


def _json_wide(rng: random.Random, p: Profile, b: bytes) -> bytes:
    coding = rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
    return b.decode().encode(coding)


def _json_not_json(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice(
        [
            b"",
            b"   \n\t ",
            b"{'model': 'x'}",
            b'{model: "x"}',
            b[:-1] + b",}",
            b'{"a": 1 /* comment */}',
            b'{"messages": [1,]}',
            b'{"content": "a\tb\nc"}',
            b'{"a": "\\x41"}',
            b'{"a": "\\u12"}',
            b'{"a": "\\uZZZZ"}',
            b'{"a": "\\',
            b'{"a": 01}',
            b'{"a": .5}',
            b'{"a": +1}',
            b'{"a": 0x10}',
            b'{"a": 1e}',
            b'{"a": -}',
            b"\x00" * 64,
            b"model=m1&prompt=hi",
        ]
    )


_JSON_BREAKERS: list[tuple[str, Callable[[random.Random, Profile, bytes], bytes]]] = [
    ("truncated", _json_truncated),
    ("trailing garbage", _json_trailing),
    ("byte order mark", _json_bom),
    ("NaN/Infinity literal", _json_nan_literal),
    ("duplicate keys", _json_duplicate_keys),
    ("50k duplicate keys", _json_many_duplicates),
    ("deep nesting", _json_deep),
    ("top-level not an object", _json_top_level),
    ("non-UTF-8 bytes", _json_non_utf8),
    ("latin-1 body", _json_latin1),
    ("UTF-16/32 body", _json_wide),
    ("not JSON", _json_not_json),
]


def json_case(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(body_paths(p))
    name, breaker = rng.choice(_JSON_BREAKERS)
    body = breaker(rng, p, valid_bytes(rng, p, path))
    label = f"json {name}"
    if name == "deep nesting":
        label += f" ({body.count(b'[') + body.count(b'{')} brackets)"
    return post(p, path, body, label=label)
