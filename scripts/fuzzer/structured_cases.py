"""Seeded structured-output fuzz cases: ``make_structured_case`` draws a generator by weight
(schema_gens.py, text_gens.py), its sizes (draw.py), the field that carries the constraint, the
path and the sampling. Case ``index`` of ``seed`` is a pure function of (seed, index, model,
max_rung), so a report's numbers rebuild any case alone. The weight table draws in list order:
reordering it changes every seed's cases."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from scripts.fuzzer import schema_gens as s
from scripts.fuzzer import text_gens as t
from scripts.fuzzer.constraints import CARRIERS, Constraint, constrained_body
from scripts.fuzzer.draw import TOP_RUNG, Draw
from scripts.fuzzer.profile import CHAT, COMPLETIONS, Profile
from scripts.fuzzer.request import Case, post

GENERATORS: list[tuple[Callable[[Draw], tuple[str, Constraint]], int]] = [
    (s.schema_small, 14), (s.json_object, 2), (s.schema_deep_nesting, 4), (s.schema_ref_chain, 5),
    (s.schema_ref_recursive, 4), (s.schema_wide_anyof, 4), (s.schema_wide_enum, 3),
    (s.schema_wide_properties, 3), (s.schema_pattern_properties, 4),
    (s.schema_pathological_values, 4), (s.schema_garbage, 5), (s.schema_mixture, 4),
    (t.regex_simple, 8), (t.regex_counted, 5), (t.regex_alternation, 3), (t.regex_unicode, 2),
    (t.regex_garbage, 3), (t.lark_simple, 4), (t.lark_chain_gen, 4), (t.lark_recursive, 4),
    (t.gbnf, 3), (t.grammar_garbage, 3), (t.choice, 5), (s.tools_required, 6),
]  # fmt: skip
MAX_TOKENS = ([2, 4, 8, 16], [1, 2, 3, 2])  # small: 2,000 cases fit in minutes


@dataclass(frozen=True)
class StructuredCase:
    generator: str
    detail: str  # what the generator drew, e.g. "plain depth=3000"
    constraint: Constraint
    http: Case  # the request as sent
    seed: int
    index: int

    @property
    def label(self) -> str:
        return f"{self.generator} {self.detail} ({self.http.label})"


def _profile(model: str) -> Profile:
    return Profile(name="structured", model=model)


def make_structured_case(
    seed: int, index: int, model: str, max_rung: int = TOP_RUNG
) -> StructuredCase:
    """Case ``index`` of ``seed``, the same on every run and machine."""
    rng = random.Random(f"{seed}/structured/{index}")
    makers, weights = zip(*GENERATORS, strict=True)
    maker = rng.choices(makers, weights)[0]
    detail, constraint = maker(Draw(rng, max_rung))
    carrier = rng.choice(CARRIERS[constraint.kind])
    if constraint.kind == "tools":
        path = CHAT
    else:
        chat_share = 0.3 if constraint.kind == "grammar" else 0.6
        path = CHAT if rng.random() < chat_share else COMPLETIONS
    sampling = {"temperature": rng.choice([0, 0, 0.8]), "seed": index}
    body = constrained_body(
        constraint, model, path, rng.choices(*MAX_TOKENS)[0], carrier, **sampling
    )
    data = json.dumps(body).encode()
    http = post(_profile(model), path, data, label=f"{carrier} on {path}, {len(data)} bytes")
    return StructuredCase(maker.__name__, detail, constraint, http, seed, index)


def plain_request(model: str, max_tokens: int = 4) -> Case:
    """The victim's request: a small chat with no constraint."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}]}
    data = json.dumps({**body, "max_tokens": max_tokens}).encode()
    return post(_profile(model), CHAT, data, label="plain")


def tiny_schema_request(model: str, tag: str) -> Case:
    """A constrained request any engine compiles at once: whether constraints still work. Its
    ``tag`` (a title) makes it a schema the engine has not compiled yet, so that its compile
    cache cannot answer it past a wedged compiler."""
    c = Constraint("json_schema", {"type": "boolean", "title": tag})
    data = json.dumps(constrained_body(c, model, CHAT, 2)).encode()
    return post(_profile(model), CHAT, data, label="tiny schema")
