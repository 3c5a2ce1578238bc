"""Static limits on a constraint, checked before any compile: the shapes that make the grammar
library recurse past its stack (a 3,000-deep `$ref` chain, 3,000 chained Lark rules), explode in
time (hundreds of `patternProperties`, thousands of optional properties) or in memory (a regex
whose counted repetitions multiply to a million). Each refusal is a 400 with code
``grammar_too_complex`` naming the limit; what passes still compiles in a worker process with a
stack, memory and time limit (engine.structured.workers), so these are the cheap first line, not
the only one. Every walk here is iterative: the inputs are adversarial.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

GRAMMAR_TOO_COMPLEX = "grammar_too_complex"


@dataclass(frozen=True)
class ConstraintLimits:
    """What one constraint may ask of the compiler (docs/STRUCTURED_OUTPUTS.md#limits)."""

    max_bytes: int = 256 * 1024  # the schema's JSON text, the regex, the grammar
    max_depth: int = 64  # subschemas inside subschemas, `$ref` hops included; regex groups
    max_branches: int = 1000  # items of one anyOf / oneOf / allOf
    max_properties: int = 1000  # properties of one object schema
    max_pattern_properties: int = 64  # patternProperties of one object schema
    max_repetition: int = 10_000  # a regex's counted repetitions multiplied through their nesting
    max_grammar_rules: int = 1000  # rule definitions of a Lark or GBNF grammar


def too_complex(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="response_format", code=GRAMMAR_TOO_COMPLEX)


def _over(what: str, value: int, limit: int, name: str) -> InvalidRequestError:
    return too_complex(f"{what} is {value:,}, over this engine's limit of {limit:,} ({name})")


def check_size(text: str, limits: ConstraintLimits) -> None:
    size = len(text.encode())
    if size > limits.max_bytes:
        raise _over("the constraint's size in bytes", size, limits.max_bytes, "max_bytes")


def check_constraint(kind: str, value: str, schema: Any, limits: ConstraintLimits) -> None:
    """Raise the 400 of the first limit `value` (of constraint `kind`; `schema`: its parsed JSON
    schema, for json_schema) goes past."""
    check_size(value, limits)
    if kind == "json_schema":
        check_schema(schema, limits)
    elif kind == "regex":
        check_regex(value, limits)
    elif kind == "grammar":
        check_grammar(value, limits)


# ---- JSON Schema ---------------------------------------------------------------------------

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = (
    "items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_BRANCHES = ("anyOf", "oneOf", "allOf")


def _subschemas(node: dict) -> Iterator[Any]:
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#/$defs/a", "#/properties/x/items") points at, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_node(node: dict, limits: ConstraintLimits) -> None:
    for key in _BRANCHES:
        if isinstance(node.get(key), list) and len(node[key]) > limits.max_branches:
            raise _over(f"the number of {key} branches", len(node[key]), limits.max_branches,
                        "max_branches")  # fmt: skip
    props = node.get("properties")
    if isinstance(props, dict) and len(props) > limits.max_properties:
        raise _over("the number of properties of one object", len(props), limits.max_properties,
                    "max_properties")  # fmt: skip
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        if len(patterns) > limits.max_pattern_properties:
            raise _over("the number of patternProperties", len(patterns),
                        limits.max_pattern_properties, "max_pattern_properties")  # fmt: skip
        for pattern in patterns:
            check_regex(pattern, limits)
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], limits)


def check_schema(root: Any, limits: ConstraintLimits) -> None:
    """The schema's shape against `limits`. Depth is the longest chain of subschemas, `$ref`
    hops counted as steps into their target (a chain of $defs is as deep as nesting); a `$ref`
    back into a subschema being expanded is recursion, which the library expands lazily, so it
    adds nothing."""
    depth: dict[int, int] = {}  # id(subschema) -> its depth, once known
    expanding: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, dict):
            continue
        key = id(node)
        children = list(_subschemas(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and (target := _pointer(root, ref)) is not None:
            children.append(target)
        if children_done:
            expanding.discard(key)
            below = [depth.get(id(c), 0) for c in children if isinstance(c, dict)]
            depth[key] = 1 + max(below, default=0)
            if depth[key] > limits.max_depth:
                raise _over("the schema's nesting depth ($ref chains included)", depth[key],
                            limits.max_depth, "max_depth")  # fmt: skip
            continue
        if key in depth or key in expanding:
            continue
        _check_node(node, limits)
        expanding.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if isinstance(c, dict) and id(c) not in depth)


# ---- regular expressions -------------------------------------------------------------------

_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_regex(pattern: str, limits: ConstraintLimits) -> None:
    """Group nesting, and counted repetitions of groups that hold counted repetitions themselves:
    `(ab{1000}){1000}` asks the lexer for a million-fold expansion (2.7 s and 177 MB for its first
    mask), while one `.{0,100000}` costs nothing. A scan, not a parser: escapes and character
    classes are skipped; `{n}`, `{n,}` and `{n,m}` count their largest bound."""
    depth = 0
    inside: list[int] = [1]  # per open group: the largest repetition product inside it so far
    repeated = 1  # the product inside the group just closed (what a following {n} repeats)
    i = 0
    while i < len(pattern):
        char, closed = pattern[i], 1
        if char == "\\":
            i += 1
        elif char == "[":
            i = _class_end(pattern, i) - 1
        elif char == "(":
            depth += 1
            if depth > limits.max_depth:
                raise _over("the regex's group nesting", depth, limits.max_depth, "max_depth")
            inside.append(1)
        elif char == ")" and len(inside) > 1:
            depth -= 1
            closed = inside.pop()
        elif char == "{" and (counted := _COUNTED.match(pattern, i)):
            count = int(counted.group(2) or counted.group(1))
            product = repeated * max(count, 1)
            if repeated > 1 and product > limits.max_repetition:
                raise _over("the regex's nested repetition count", product,
                            limits.max_repetition, "max_repetition")  # fmt: skip
            inside[-1] = max(inside[-1], product)
            i = counted.end() - 1
        repeated = closed
        i += 1


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at `start` (`]` first is a literal)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


# ---- grammars ------------------------------------------------------------------------------

# String and regex literals and comments, which may hold anything; what is left is the structure.
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*|#[^\n]*')
# A rule (or terminal) definition at the start of a line: Lark's `name:`, `?name:`, `NAME.2:`,
# `name{x}:` templates, or GBNF's `name ::=`.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\{[^}\n]*\})?[ \t]*(?::|::=)", re.MULTILINE)


def check_grammar(text: str, limits: ConstraintLimits) -> None:
    """Rule definitions and bracket nesting of a Lark or GBNF grammar."""
    structure = _LITERALS.sub('""', text)
    rules = len(_RULE.findall(structure))
    if rules > limits.max_grammar_rules:
        raise _over("the grammar's number of rules", rules, limits.max_grammar_rules,
                    "max_grammar_rules")  # fmt: skip
    depth = deepest = 0
    for char in structure:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    if deepest > limits.max_depth:
        raise _over("the grammar's bracket nesting", deepest, limits.max_depth, "max_depth")
