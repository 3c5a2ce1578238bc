"""A constraint (kind and text, engine.core.sampling_params.StructuredOutput) as an llguidance
grammar, and the checks that turn a bad one into a 400 naming what is wrong."""

from __future__ import annotations

import json
from typing import Any, Protocol

import llguidance

from common.errors import excerpt
from engine.errors import InvalidRequestError
from engine.structured.schema_check import (
    describe_library_error,
    load_schema,
    parse_schema,
    schema_error,
)

# JSON as `json.dumps` writes it: ", " and ": " between items, no other whitespace. Fixed
# separators keep small models from wandering into endless whitespace that a flexible grammar
# would allow, and cost nothing to models trained on such JSON.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = '{"type": "object"}'


class Constraint(Protocol):
    """What a request constrains its output to (StructuredOutput's fields)."""

    @property
    def kind(self) -> str: ...
    @property
    def value(self) -> str: ...


def _invalid(kind: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {kind} constraint: {problem}", param="response_format")


def load_constraint_schema(constraint: Constraint) -> Any:
    """A json_schema constraint's schema parsed (not yet checked against its metaschema), for the
    static limits; None for the other kinds."""
    return parse_schema(constraint.value) if constraint.kind == "json_schema" else None


def grammar_for(constraint: Constraint) -> tuple[str, Any]:
    """The llguidance grammar text of `constraint`, and its parsed JSON schema (None for the
    other kinds) for locating the keywords the library refuses later."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        schema = load_schema(value)
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS), schema
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            ANY_JSON_OBJECT, defaults=JSON_OPTIONS
        ), None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value), None
    if kind == "choice":
        choices = json.loads(value)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise _invalid("choice", "must be a non-empty array of strings")
        return llguidance.grammar_from("choice", value), None
    if kind == "grammar":
        try:  # Lark as is; GBNF (llama.cpp's `root ::= ...`) converted to Lark
            return llguidance.grammar_from("grammar", value), None
        except ValueError as error:
            raise _invalid("grammar", excerpt(str(error))) from None
    raise _invalid(kind, "unknown kind")


def library_error(constraint: Constraint, message: str, schema: Any) -> InvalidRequestError:
    """The 400 for a grammar llguidance refused with `message`."""
    if constraint.kind == "json_schema":
        return schema_error(describe_library_error(message, schema))
    # The first line says where; the rest echo the source with a caret, then the cause.
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return _invalid(constraint.kind, excerpt(" ".join(kept) or "unknown error", 300))


# llguidance's stop reasons when it gives up on a grammar's size (its limits on lexer states,
# Earley items and fuel), and when the grammar can go no further. After a failed token it reports
# InternalError instead, and its state dump names some stop reason whatever happened: the error's
# first line tells a refused token or a dead end from a give-up.
TOO_COMPLEX_STOPS = ("ParserTooComplex", "LexerTooComplex")
DEAD_END_STOPS = ("NoExtension", "NoExtensionBias")
_TOKEN_REFUSED = "doesn't satisfy the grammar"


def failure_kind(matcher: llguidance.LLMatcher) -> str:
    """Why a matcher is in error: "too_complex" (the library gave up on the grammar's size),
    "dead_end" (the grammar allows nothing more) or "refused" (it ruled the token out)."""
    reason = matcher.stop_reason()
    if reason in TOO_COMPLEX_STOPS:
        return "too_complex"
    lines = matcher.get_error().strip().splitlines()
    first = lines[0] if lines else ""
    if reason in DEAD_END_STOPS or first in DEAD_END_STOPS or not first:
        return "dead_end"
    return "refused" if _TOKEN_REFUSED in first else "too_complex"
