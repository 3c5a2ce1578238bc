"""Narrow weights cached per checkpoint and mode, so that a second start skips what the first
did to get them: reading a GGUF's blocks (gguf's reader parses every metadata field first), checking
each against the dense weight, quantising the rest.

One safetensors file per (checkpoint folder as loaded, mode) under <cache>/narrow/, keyed by the
folder's weight and config files (name, size, mtime) and `LAYOUT_VERSION`; written whole under a
temporary name, then renamed, so readers see no file or a complete one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine.model.cache_dir import cache_root
from engine.model.cpu.quant_formats import QuantizedWeight

log = logging.getLogger(__name__)

# Bump when quant_formats' records change meaning.
LAYOUT_VERSION = 2
_KEYED_SUFFIXES = (".safetensors", ".bin", ".json")

# A parameter's choice: its narrow weight (None: left dense) and whether the file held it as is.
Choice = tuple[QuantizedWeight | None, bool]


def cache_path(source: Path, mode: str) -> Path:
    files = sorted(p for p in source.iterdir() if p.suffix in _KEYED_SUFFIXES)
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    ident = json.dumps([str(source.resolve()), stats, mode, LAYOUT_VERSION])
    key = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return cache_root() / "narrow" / f"{key}.safetensors"


def load(path: Path) -> dict[str, Choice] | None:
    """The choices saved at ``path`` by parameter name, or None without a readable file."""
    try:
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            entries = json.loads(f.metadata()["choices"])
    except (OSError, SafetensorError, ValueError, KeyError, TypeError):
        return None
    choices: dict[str, Choice] = {}
    for name, (fmt, in_features, native) in entries.items():
        weight = None if fmt is None else QuantizedWeight(fmt, in_features, tensors[name])
        choices[name] = (weight, native)
    return choices


def save(path: Path, choices: dict[str, Choice]) -> None:
    """Write ``choices`` to ``path`` (a failure only logs: the cache is an optimisation)."""
    tensors = {name: w.records.contiguous() for name, (w, _) in choices.items() if w is not None}
    entries = {
        name: (None, 0, native) if w is None else (w.fmt, w.in_features, native)
        for name, (w, native) in choices.items()
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, temp, metadata={"choices": json.dumps(entries)})
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.remove(temp)
    except OSError as exc:
        log.warning("narrow weights not cached in %s: %s", path.parent, exc)
