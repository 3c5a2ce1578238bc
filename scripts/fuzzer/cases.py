"""Seeded HTTP fuzz cases for both servers: ``make_case`` and the mix of families.

Case ``index`` of seed ``seed`` is a pure function of (profile, seed, index): its own
``random.Random`` is seeded from those three, so any case is rebuilt alone from the numbers a
report gives (``make_case(profile, seed, index)``), without generating the ones before it.

Three families, mixed by weight:

- ``field`` (scripts/fuzzer/fields.py): a valid /v1/chat/completions or /v1/completions body
  (engine: also /tokenize and /detokenize) with one to three fields, at any depth, replaced by a
  value of another JSON type or an edge value (huge numbers, NaN, lone surrogate escapes, NUL,
  RTL, huge strings...), or removed.
- ``json`` (broken_json.py): the bytes of a valid body broken: truncated, trailing garbage, BOM,
  NaN literals, duplicate keys, nesting 100 / 1,000 / 100,000 deep, other top-level types,
  non-UTF-8, UTF-16/32.
- ``http`` (http_bodies.py, http_heads.py): compressed bodies (valid, invalid, truncated, bombs),
  Content-Length and chunked framing errors, Expect, Content-Type, Authorization and other
  headers of odd bytes and shapes, wrong methods, unknown paths, odd request lines and non-HTTP
  bytes; the engine's /tokenize and /detokenize, the gateway's /admin/* and /v1/models.

Every case stays under a few MB, so thousands run in seconds. The weight tables below draw in
list order: reordering them changes every seed's cases.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable

from scripts.fuzzer import http_bodies, http_heads
from scripts.fuzzer.broken_json import json_case
from scripts.fuzzer.fields import field_case
from scripts.fuzzer.profile import CHAT, Profile
from scripts.fuzzer.request import Case, post

_HTTP_FAMILY: list[tuple[Callable[[random.Random, Profile], Case], int]] = [
    (http_bodies.encoded_body, 6),
    (http_bodies.odd_encoding, 2),
    (http_bodies.content_length, 3),
    (http_bodies.chunked_body, 3),
    (http_bodies.odd_transfer_encoding, 1),
    (http_bodies.expect, 2),
    (http_bodies.content_type, 2),
    (http_heads.authorization, 3),
    (http_heads.odd_header, 3),
    (http_heads.malformed_head, 2),
    (http_heads.request_line, 2),
    (http_heads.not_http, 1),
    (http_heads.odd_method, 2),
    (http_heads.unknown_path, 2),
    (http_heads.get_endpoint, 2),
    (http_bodies.body_over_limit, 1),
    (http_heads.unavailable_model, 1),
]


def _http_case(rng: random.Random, p: Profile) -> Case:
    makers, weights = zip(*_HTTP_FAMILY, strict=True)
    return rng.choices(makers, weights)[0](rng, p)


_FAMILIES: list[tuple[Callable[[random.Random, Profile], Case], int]] = [
    (field_case, 50),
    (json_case, 20),
    (_http_case, 30),
]


def make_case(profile: Profile, seed: int, index: int) -> Case:
    """Case ``index`` of ``seed`` for ``profile``, the same on every run and machine."""
    rng = random.Random(f"{seed}/{profile.name}/{index}")
    makers, weights = zip(*_FAMILIES, strict=True)
    case = rng.choices(makers, weights)[0](rng, profile)
    return dataclasses.replace(case, seed=seed, index=index)


def valid_probe(profile: Profile) -> Case:
    """The request that must still succeed after a finding: a plain one-token chat."""
    body = json.dumps(
        {"model": profile.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    return post(profile, CHAT, body, label="probe")
