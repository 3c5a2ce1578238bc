"""JSON Schema checks before a schema reaches the grammar library: the schema must be valid
against its metaschema (jsonschema's check, whose errors carry the path of the bad keyword), and
the keywords the library refuses are located in the schema so the error names where they are."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from jsonschema import validators
from jsonschema.exceptions import SchemaError

from common.errors import excerpt
from engine.errors import InvalidRequestError

# Keywords whose object values map names (properties, definitions) to subschemas: their keys are
# names chosen by the schema's author, never keywords.
_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


def schema_error(message: str) -> InvalidRequestError:
    """The request error of a schema the engine cannot constrain to (the server names the
    request field it came in)."""
    return InvalidRequestError(message, param="response_format")


def parse_schema(text: str) -> Any:
    """The schema in `text` as JSON (an object or a boolean), not yet checked."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise schema_error(f"the JSON schema is not valid JSON: {error}") from None
    except RecursionError:
        raise schema_error("the JSON schema is nested too deeply to parse") from None
    if not isinstance(schema, (dict, bool)):
        raise schema_error("the JSON schema must be an object or a boolean")
    return schema


def load_schema(text: str) -> Any:
    """The schema in `text`, checked against its metaschema (its `$schema`, else 2020-12)."""
    schema = parse_schema(text)
    validator = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as error:
        raise schema_error(
            f"the JSON schema is invalid at {error.json_path}: {excerpt(error.message)}"
        ) from None
    return schema


def keyword_paths(schema: Any, keywords: set[str], path: str = "$") -> Iterator[str]:
    """JSON paths of every occurrence of `keywords` used as schema keywords."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from keyword_paths(item, keywords, f"{path}[{i}]")
    elif isinstance(schema, dict):
        for key, value in schema.items():
            here = f"{path}.{key}"
            if key in keywords:
                yield here
            if key in _NAME_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from keyword_paths(sub, keywords, f"{here}.{name}")
            else:
                yield from keyword_paths(value, keywords, here)


def describe_library_error(message: str, schema: Any) -> str:
    """The grammar library's error, with the schema paths of the keywords it does not
    implement (its message names the keywords only)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    found = _UNIMPLEMENTED.search(message)
    if found is None:
        return f"the JSON schema cannot be used for constrained decoding: {excerpt(first)}"
    keywords = set(json.loads(found.group(1)))
    paths = list(keyword_paths(schema, keywords))[:8]
    where = f" (at {', '.join(paths)})" if paths else ""
    return (
        "the JSON schema uses keywords that constrained decoding does not support: "
        f"{', '.join(sorted(keywords))}{where}"
    )
