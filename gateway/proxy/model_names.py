"""Answers carry the upstream's own model name (``upstream_model``); clients see the served name.
Rewritten on the bytes, unary answers and stream events alike, without decoding the JSON."""

from __future__ import annotations

import json

from gateway.config import ModelConfig

Rename = tuple[bytes, bytes]  # (the upstream's name, the served name), each as a JSON string


def rename_for(config: ModelConfig) -> Rename | None:
    """None when the upstream knows the model by its served name."""
    if not config.upstream_model or config.upstream_model == config.name:
        return None
    return json.dumps(config.upstream_model).encode(), json.dumps(config.name).encode()


def rename_model(data: bytes, rename: Rename) -> bytes:
    wire, served = rename
    return data.replace(b'"model":' + wire, b'"model":' + served).replace(
        b'"model": ' + wire, b'"model": ' + served
    )
