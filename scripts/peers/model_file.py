"""What the benchmarks need to know of a GGUF a user brings: the name to serve it under (from the
file name), its weight type (``general.file_type``: Q4_1, Q4_K_M, ...) and the bytes of KV cache
one token takes in Modelyard's engine, all from the file's header without loading it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf

from scripts.peers.gguf_header import Header, read_header

# The gateway accepts letters, digits and ._:/@+- in a model name (gateway/config/models.py);
# the file's stem, lower-cased, with anything else turned into "-", is always one.
_NOT_NAME = re.compile(r"[^a-z0-9._-]+")
KV_ELEMENT_BYTES = 4  # the engine's KV cache on CPU: --kv-cache-dtype auto = the fp32 model dtype


@dataclass(frozen=True)
class ModelFile:
    path: Path
    name: str  # the served model name
    file_type: str  # "Q4_1", "Q4_K_M", "F16", ...
    bytes: int

    def describe(self) -> dict:
        return {"path": str(self.path), "bytes": self.bytes, "file_type": self.file_type}


def served_name(path: Path) -> str:
    """``models/SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.q4_1``."""
    name = _NOT_NAME.sub("-", path.stem.lower()).strip("-._")
    return name[:120] or "model"


def unique_names(paths: list[Path]) -> list[str]:
    """One served name per file, in order; a name two files share gets -2, -3 ... after it."""
    seen: Counter[str] = Counter()
    names = []
    for path in paths:
        name = served_name(path)
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return names


def file_type(header: Header) -> str:
    """The file's declared type; without one, the type most of its matrix bytes have."""
    declared = header.metadata.get("general.file_type")
    if isinstance(declared, int):
        try:
            return gguf.LlamaFileType(declared).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    by_type: Counter[str] = Counter()
    for t in header.tensors:
        if len(t.shape) >= 2:
            by_type[t.ggml_type] += t.n_bytes
    return by_type.most_common(1)[0][0] if by_type else "unknown"


def kv_bytes_per_token(path: Path, element_bytes: int = KV_ELEMENT_BYTES) -> int:
    """K and V of one token over all layers, as the engine allocates them: every layer holds the
    full context (sliding-window layers too), head size from ``key_length`` or the embedding
    width over the heads."""
    metadata = read_header(path).metadata
    arch = metadata.get("general.architecture")

    def meta(key: str) -> int | None:
        value = metadata.get(f"{arch}.{key}")
        return int(value) if isinstance(value, (int, float)) else None

    layers, heads = meta("block_count"), meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv") or heads
    head_dim = meta("attention.key_length")
    if head_dim is None and heads:
        head_dim = (meta("embedding_length") or 0) // heads
    if not (layers and kv_heads and head_dim):
        raise ValueError(f"{arch}: no layer count, KV heads or head size in the GGUF header")
    return 2 * layers * kv_heads * head_dim * element_bytes


def open_models(paths: list[Path]) -> list[ModelFile]:
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such GGUF: {', '.join(missing)}")
    return [
        ModelFile(path, name, file_type(read_header(path)), path.stat().st_size)
        for path, name in zip(paths, unique_names(paths), strict=True)
    ]
