"""Faster reads of a GGUF's metadata for transformers' one-time conversion of its config
(engine.model.loader caches what it builds).

transformers builds the config from gguf's GGUFReader (load_gguf_checkpoint), which makes numpy
views of every metadata value -- ~790,000 for Gemma 3's 262,144-token vocabulary -- then parses
each back into a Python value: seconds, for a config that reads the vocabulary only to count its
tokens (the vocabulary size, where the architecture's keys do not state it). Inside
`fast_gguf_reads`, ``gguf.GGUFReader(path)`` is a MetadataReader of the file
engine.model.cpu.gguf_file read: the same fields, laid out as GGUFReader lays them out, without
the vocabulary's arrays. The count they stand for is the architecture's vocab_size key where the
file lacks it and transformers maps one; for an architecture it maps none from, the tokens stay,
each an empty string (figures: docs/PERFORMANCE.md#model-loading).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from engine.model.cpu.gguf_file import GgufFile

_TOKENS = "tokenizer.ggml.tokens"
_VOCABULARY = (
    _TOKENS,
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


class TensorName(NamedTuple):
    """A tensor as load_gguf_checkpoint reads it without tensors: its name."""

    name: str


class MetadataReader:
    """What load_gguf_checkpoint reads of a GGUFReader of ``file`` (read with its strings)."""

    def __init__(self, file: GgufFile) -> None:
        self.fields = {
            key: _field(file, key, types)
            for key, types in file.types.items()
            if key not in _VOCABULARY
        }
        self.fields.update(_vocabulary_size(file))
        self.tensors = [TensorName(name) for name in file.tensors]


def _vocabulary_size(file: GgufFile) -> dict[str, ReaderField]:
    """The field the config counts the tokens by, if it needs one."""
    architecture = str(file.fields.get("general.architecture"))
    key = f"{architecture}.vocab_size"
    tokens = file.arrays.get(_TOKENS)
    if tokens is None or key in file.types:
        return {}
    if GGUF_CONFIG_MAPPING.get(architecture, {}).get("vocab_size"):
        return {
            key: _field_of(
                key, [GGUFValueType.UINT32], [_scalar(tokens.count, GGUFValueType.UINT32)], [0]
            )
        }
    parts = [
        _scalar(GGUFValueType.STRING, GGUFValueType.UINT32),
        _scalar(tokens.count, GGUFValueType.UINT64),
        _bytes(b""),
    ]
    return {
        _TOKENS: _field_of(
            _TOKENS, [GGUFValueType.ARRAY, GGUFValueType.STRING], parts, [2] * tokens.count
        )
    }


def _field(file: GgufFile, key: str, types: list[int]) -> ReaderField:
    if types[0] == GGUFValueType.ARRAY:
        parts, data = _array(file, key, types[1])
    elif types[0] == GGUFValueType.STRING:
        text = _bytes(str(file.fields[key]).encode())
        parts, data = [_scalar(len(text), GGUFValueType.UINT64), text], [1]
    else:
        parts, data = [_scalar(file.fields[key], GGUFValueType(types[0]))], [0]
    return _field_of(key, types, parts, data)


def _field_of(key: str, types: list[int], parts: list[np.ndarray], data: list[int]) -> ReaderField:
    """GGUFReader's field: parts [key length, key, type, value parts...], data indexing the
    values among them."""
    encoded = key.encode()
    head = [
        _scalar(len(encoded), GGUFValueType.UINT64),
        _bytes(encoded),
        _scalar(types[0], GGUFValueType.UINT32),
    ]
    return ReaderField(
        0, key, head + parts, [len(head) + i for i in data], [GGUFValueType(t) for t in types]
    )


def _array(file: GgufFile, key: str, item: int) -> tuple[list[np.ndarray], list[int]]:
    array = file.arrays[key]
    parts = [_scalar(item, GGUFValueType.UINT32), _scalar(array.count, GGUFValueType.UINT64)]
    if isinstance(array.values, np.ndarray):
        parts += [array.values[i : i + 1] for i in range(array.count)]
        return parts, list(range(2, len(parts)))
    if isinstance(array.values, list):
        for text in array.values:
            encoded = text.encode()
            parts += [_scalar(len(encoded), GGUFValueType.UINT64), _bytes(encoded)]
        return parts, list(range(3, len(parts), 2))
    raise ValueError(f"{key}: an array of arrays, or strings not read")


def _scalar(value: object, kind: GGUFValueType) -> np.ndarray:
    return np.array([value], GGUFReader.gguf_scalar_to_np[kind])


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


@contextlib.contextmanager
def fast_gguf_reads(path: Path, file: GgufFile) -> Iterator[None]:
    """Within: ``gguf.GGUFReader(path)`` (which transformers looks up at each call) is a
    MetadataReader of ``file``, read from ``path`` with its strings; another path gets gguf's
    own reader. Only for a single thread's conversion: the swap is global."""
    reader = MetadataReader(file)
    original = gguf.GGUFReader

    def read(other: os.PathLike[str] | str, mode: str = "r") -> object:
        return reader if Path(other).resolve() == path.resolve() else original(other, mode)  # type: ignore[arg-type]

    gguf.GGUFReader = read  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
