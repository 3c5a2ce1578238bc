"""Generators of JSON-schema constraints (and of tools, whose parameters are schemas): small
sane ones whose outputs a validator can judge, and deep, wide and pathological ones. Each takes
a Draw and returns (what it drew, Constraint). Every ``pattern`` here is one Python's re reads
as Rust's regex does, and none nests ambiguous repetitions (the validator must not backtrack for
minutes)."""

from __future__ import annotations

import json
from typing import Any

from scripts.fuzzer.constraints import (
    Constraint,
    anyof_objects,
    pattern_properties,
    ref_chain,
    ref_chain_tools,
    tool,
)
from scripts.fuzzer.draw import Draw

Generated = tuple[str, Constraint]
WORDS = ["red", "green", "blue", "yes", "no", "alpha", "beta", "🙂", "naïve", "a b", ""]


def _schema(detail: str, value: Any) -> Generated:
    return detail, Constraint("json_schema", value)


def small_schema(d: Draw, depth: int = 0) -> dict[str, Any]:
    """A schema of at most three levels whose outputs are short: bounded numbers, enums,
    short strings, objects of up to three properties, arrays of up to three items."""
    r = d.rng
    leaves = ["boolean", "integer", "number", "enum", "const", "string", "null", "types"]
    kind = r.choice(leaves + (["object", "array", "anyOf"] * 2 if depth < 2 else []))
    if kind == "integer":
        low = r.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + r.choice([0, 9, 1000])}
    if kind == "number":
        extra = {"multipleOf": 0.5} if r.random() < 0.3 else {}
        return {"type": "number", "minimum": 0, "maximum": r.choice([1, 10, 1e6]), **extra}
    if kind == "enum":
        return {"enum": r.sample([*WORDS, 1, 2.5, None, True], r.randint(1, 5))}
    if kind == "const":
        return {"const": r.choice(["yes", 42, None, False, "é✓"])}
    if kind == "string":
        return r.choice(
            [
                {"type": "string", "maxLength": r.randint(0, 8)},
                {"type": "string", "pattern": "^[a-z]{1,4}$"},
                {"type": "string", "pattern": "^[0-9]{2}-[A-F]{2}$"},
                {"type": "string", "minLength": 2, "maxLength": 3},
                {"type": "string", "format": r.choice(["date", "email", "uuid", "ipv4"])},
            ]
        )
    if kind == "object":
        props = {f"k{i}": small_schema(d, depth + 1) for i in range(r.randint(0, 3))}
        required = sorted(r.sample(sorted(props), r.randint(0, len(props))))
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    if kind == "array":
        return {
            "type": "array",
            "items": small_schema(d, depth + 1),
            "minItems": r.randint(0, 1),
            "maxItems": r.randint(1, 3),
        }
    if kind == "anyOf":
        return {"anyOf": [small_schema(d, depth + 1), small_schema(d, depth + 1)]}
    if kind == "types":
        return {"type": r.choice([["integer", "null"], ["boolean", "string"]]), "maxLength": 3}
    return {"type": kind}  # boolean, null


def schema_small(d: Draw) -> Generated:
    return _schema("small", small_schema(d))


def schema_deep_nesting(d: Draw) -> Generated:
    """One leaf inside ``depth`` wrappers; past ~40 object wrappers the body's JSON nests over the
    servers' 128 levels, which must be a 400."""
    depth = d.size((3, 12, 40, 120, 300))
    wrap = d.rng.choice(["object", "array", "anyOf", "allOf", "mixed"])
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(depth):
        w = d.rng.choice(["object", "array", "anyOf", "allOf"]) if wrap == "mixed" else wrap
        if w == "object":
            schema = {
                "type": "object",
                "properties": {"a": schema},
                "required": ["a"],
                "additionalProperties": False,
            }
        elif w == "array":
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
        elif w == "anyOf":
            schema = {"anyOf": [schema, {"type": "null"}]}
        else:
            schema = {"allOf": [schema]}
    return _schema(f"{wrap} depth={depth}", schema)


def schema_ref_chain(d: Draw) -> Generated:
    depth = d.size((3, 40, 400, 2000, 3000))
    style = d.rng.choice(["plain", "plain", "property", "allOf", "array"])
    return _schema(f"{style} depth={depth}", ref_chain(depth, style))


def schema_ref_recursive(d: Draw) -> Generated:
    kind = d.rng.choice(["list", "tree", "ring", "self", "root"])
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    if kind == "list":
        node = {
            "type": "object",
            "required": ["v", "next"],
            "additionalProperties": False,
            "properties": {
                "v": digit,
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
        }
        return _schema(kind, {"$defs": {"node": node}, "$ref": "#/$defs/node"})
    if kind == "tree":
        node = {
            "type": "object",
            "required": ["v"],
            "additionalProperties": False,
            "properties": {
                "v": digit,
                "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
            },
        }
        return _schema(kind, {"$defs": {"node": node}, "$ref": "#/$defs/node"})
    if kind == "ring":  # mutual recursion through n definitions, with a way out at each
        n = d.size((2, 10, 100, 1000, 3000))
        defs = {f"r{i}": {"anyOf": [{"$ref": f"#/$defs/r{(i + 1) % n}"}, digit]} for i in range(n)}
        return _schema(f"ring n={n}", {"$defs": defs, "$ref": "#/$defs/r0"})
    if kind == "self":  # no way out at all
        return _schema(kind, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    return _schema(kind, {"type": "object", "properties": {"x": {"$ref": "#"}, "v": digit}})


def schema_wide_anyof(d: Draw) -> Generated:
    n = d.size((2, 20, 300, 2000, 5000))
    shape = d.rng.choice(["objects", "consts", "strings"])
    if shape == "objects":
        return _schema(f"objects n={n}", anyof_objects(n, str(d.rng.randint(0, 999))))
    if shape == "consts":
        return _schema(f"consts n={n}", {"anyOf": [{"const": f"v{i}"} for i in range(n)]})
    branches = [{"type": "string", "pattern": f"^s{i}[a-z]?$"} for i in range(n)]
    return _schema(f"string patterns n={n}", {"anyOf": branches})


def schema_wide_enum(d: Draw) -> Generated:
    n = d.size((3, 50, 1000, 10000, 60000))
    shape = d.rng.choice(["words", "numbers", "prefixes", "mixed"])
    values: list[Any] = {
        "words": [f"w{i}" for i in range(n)],
        "numbers": [i * 7 - n for i in range(n)],
        "prefixes": ["a" * (i % 40) + str(i) for i in range(n)],  # long shared prefixes
        "mixed": [[f"w{i}", i, i + 0.5][i % 3] for i in range(n)] + [None, True, False],
    }[shape]
    return _schema(f"{shape} n={n}", {"enum": values})


def schema_wide_properties(d: Draw) -> Generated:
    n = d.size((2, 20, 300, 3000, 20000))
    props = {f"p{i}": {"type": d.rng.choice(["integer", "boolean"])} for i in range(n)}
    required = d.rng.choice(["all", "none", "some"])
    names = {"all": list(props), "none": [], "some": list(props)[: max(1, n // 10)]}[required]
    schema = {
        "type": "object",
        "properties": props,
        "required": names,
        "additionalProperties": d.rng.random() < 0.5,
    }
    return _schema(f"n={n} required={required}", schema)


def schema_pattern_properties(d: Draw) -> Generated:
    n = d.size((2, 10, 80, 300, 2000))
    disjoint = d.rng.random() < 0.8
    schema = pattern_properties(n, disjoint)
    if d.rng.random() < 0.5:
        schema["additionalProperties"] = False
    return _schema(f"n={n} disjoint={disjoint}", schema)


def schema_pathological_values(d: Draw) -> Generated:
    """Bounds that are huge, tiny, contradictory or take a long output to meet."""
    big = d.size((2, 100, 10**4, 10**6, 10**9))
    n = d.size((2, 10, 100, 1000, 5000))
    options: dict[str, Any] = {
        "minLength": {"type": "string", "minLength": big},
        "maxLength": {"type": "string", "maxLength": big},
        "nested pattern": {"type": "string", "pattern": f"^(ab{{0,{n}}}){{0,{n}}}$"},
        "minItems": {"type": "array", "minItems": big, "items": {"type": "integer"}},
        "nested maxItems": {
            "type": "array",
            "maxItems": big,
            "items": {"type": "array", "maxItems": big, "items": {"type": "boolean"}},
        },
        "tiny multipleOf": {"type": "number", "multipleOf": 1e-300},
        "huge integers": {"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5},
        "minimum over maximum": {"type": "integer", "minimum": 5, "maximum": 4},
        "empty exclusive range": {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
        "prefixItems": {
            "type": "array",
            "prefixItems": [{"const": i} for i in range(n)],
            "items": False,
        },
        "minProperties": {
            "type": "object",
            "minProperties": n,
            "additionalProperties": {"type": "integer"},
        },
        "date-time": {"type": "string", "format": "date-time"},
    }
    name = d.rng.choice(sorted(options))
    return _schema(f"{name} big={big} n={n}", options[name])


# Nothing falsy (null, false, []): a field set to one may count as not set, constraining nothing.
_GARBAGE: list[Any] = [
    True, "x", 1, {"type": 5}, {"type": "strnig"}, {"properties": []},
    {"required": "a"}, {"minimum": "zero"}, {"$ref": "#/$defs/missing"},
    {"$ref": "http://example.com/s.json"}, {"$ref": "#/properties/%ZZ"}, {"not": {}},
    {"if": {}, "then": {}}, {"uniqueItems": True, "type": "array"},
    {"oneOf": [{"type": "integer"}, {"type": "number"}]}, {"pattern": "(?<=a)b"},
    {"type": "string", "pattern": "(("}, {"$schema": "http://json-schema.org/draft-04/schema#",
    "minimum": 1, "exclusiveMinimum": True}, {"$schema": "x" * 10000}, {"format": "no-format"},
    {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
    {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"enum": []}, {"anyOf": []},
    {"$defs": {"a": 5}, "$ref": "#/$defs/a"}, {"type": "array", "items": [1, 2]},
]  # fmt: skip


def schema_garbage(d: Draw) -> Generated:
    """Invalid, refused or unsatisfiable schemas, or a schema's JSON text broken."""
    if d.rng.random() < 0.2:
        text = d.rng.choice(["{not json", "[" * 5000, '{"type": "object"', "[]", "5"])
        return f"text {text[:20]!r}", Constraint("json_schema", text)
    i = d.rng.randrange(len(_GARBAGE))
    return _schema(f"#{i}", _GARBAGE[i])


def _hoisted(parts: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The parts with their ``$defs`` moved to one root (renamed apart, references followed)."""
    defs: dict[str, Any] = {}
    moved = []
    for i, part in enumerate(parts):
        part = json.loads(json.dumps(part).replace('"#/$defs/', f'"#/$defs/m{i}_'))
        if isinstance(part, dict):
            defs.update({f"m{i}_{k}": v for k, v in part.pop("$defs", {}).items()})
        moved.append(part)
    return moved, defs


def schema_mixture(d: Draw) -> Generated:
    """Two or three of the other generators' schemas under one root."""
    gens = d.rng.sample(_MIXABLE, d.rng.randint(2, 3))
    drawn = [gen(d) for gen in gens]
    parts, defs = _hoisted([c.value for _, c in drawn])
    how = d.rng.choice(["properties", "anyOf", "items"])
    if how == "properties":
        schema: dict[str, Any] = {
            "type": "object",
            "required": [f"p{i}" for i in range(len(parts))],
            "properties": {f"p{i}": p for i, p in enumerate(parts)},
        }
    elif how == "anyOf":
        schema = {"anyOf": parts}
    else:
        schema = {"type": "array", "prefixItems": parts, "items": False}
    if defs:
        schema["$defs"] = defs
    detail = f"{how} of " + ", ".join(
        f"{g.__name__}({x})" for g, (x, _) in zip(gens, drawn, strict=True)
    )
    return _schema(detail, schema)


_MIXABLE = [
    schema_small, schema_deep_nesting, schema_ref_chain, schema_ref_recursive, schema_wide_anyof,
    schema_wide_enum, schema_pattern_properties, schema_pathological_values,
]  # fmt: skip


def json_object(d: Draw) -> Generated:
    return "json_object", Constraint("json_object")


def _small_tool(d: Draw, name: str) -> dict[str, Any]:
    params = small_schema(d, 1)
    if params.get("type") != "object":
        params = {"type": "object", "properties": {"x": params}, "required": ["x"]}
    return tool(name, params)


def tools_required(d: Draw) -> Generated:
    """``tool_choice`` required (or naming a tool): 1 to 129 tools (over 128 is refused) with
    small parameters or none, or one tool whose parameters are a ``$ref`` chain or a wide anyOf."""
    shape = d.rng.choice(["small", "small", "ref chain", "wide anyOf", "none"])
    if shape == "ref chain":
        depth = d.size((3, 40, 400, 2500, 3000))
        tools = ref_chain_tools(depth)
        shape += f" depth={depth}"
    elif shape == "wide anyOf":
        n = d.size((2, 20, 300, 2000, 5000))
        params = {"type": "object", "properties": {"x": anyof_objects(n)}, "required": ["x"]}
        tools = [tool("t0", params)]
        shape += f" n={n}"
    else:
        count = d.size((1, 2, 10, 128, 129))
        tools = [
            _small_tool(d, f"t{i}")
            if shape == "small"
            else {"type": "function", "function": {"name": f"t{i}"}}
            for i in range(count)
        ]
    named = d.rng.random() < 0.3
    choice: Any = {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
    parallel = d.rng.choice([None, True, False])
    c = Constraint(
        "tools", tools, tool_choice=choice if named else "required", parallel_tool_calls=parallel
    )
    return f"{len(tools)} tools {shape} named={named} parallel={parallel}", c
