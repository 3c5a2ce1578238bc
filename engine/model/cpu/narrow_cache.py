"""Narrow weights cached per checkpoint and mode, so that a second start skips what the first
did to get them: turning a GGUF's blocks into the formats' records (1-2 s for Gemma 3 270M's),
quantising the rest.

One safetensors file per (checkpoint folder as loaded, mode) under <cache>/narrow/, keyed by the
folder's weight and config files (name, size, mtime) and `LAYOUT_VERSION`: each weight's choice
(its format and shape, whether the file held it as it is), and the records only of the weights the
load reads itself (an untied embedding table) where the others are in the packed cache's file
(engine.model.cpu.packed_cache), else of every weight (~1.1x a GGUF's size). Written whole under a
temporary name, then renamed, so readers see no file or a complete one. A file read is touched; a
write removes the files nobody read for two weeks (`cache_dir.remove_stale`): models taken out of
models.yaml must not pile up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from common.cache_dir import cache_root
from engine.model.cache_dir import remove_stale, replaced_atomically
from engine.model.cpu.packed_cache import Entry
from engine.model.cpu.quant_formats import QuantizedWeight, described

log = logging.getLogger(__name__)

# Bump when quant_formats' records change meaning.
LAYOUT_VERSION = 10
_KEYED_SUFFIXES = (".safetensors", ".bin", ".json")

# A parameter's choice: its narrow weight (None: left dense) and whether the file held it as is.
Choice = tuple[QuantizedWeight | None, bool]


def cache_path(source: Path, mode: str) -> Path:
    files = sorted(p for p in source.iterdir() if p.suffix in _KEYED_SUFFIXES)
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    ident = json.dumps([str(source.resolve()), stats, mode, LAYOUT_VERSION])
    key = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return cache_root() / "narrow" / f"{key}.safetensors"


class CachedChoices(Mapping[str, Choice]):
    """The choices saved in one cache file, by parameter name, each weight read from the mapped
    file when asked for: a whole model's records never sit in memory at once (Gemma 3 270M's
    are 340 MB), only as each becomes its kernel layout. Where the file was saved with the
    entries of the packed cache's file (``packed``), only the weights the load reads itself have
    records; the others are described (engine.model.cpu.quant_formats.described), and a load
    uses them only where that packed file is still there to map."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(path, "pt")
        metadata = self._file.metadata()
        self._entries: dict[str, list] = json.loads(metadata["choices"])
        self._stored = set(self._file.keys())
        packed = metadata.get("packed")
        self.packed: list[Entry] | None = None
        if packed is not None:
            self.packed = [(fmt, n, k) for fmt, n, k in json.loads(packed)]

    def __getitem__(self, name: str) -> Choice:
        fmt, in_features, native, out_features = self._entries[name]
        if fmt is None:
            return None, native
        if name not in self._stored:
            return described(fmt, out_features, in_features), native
        return QuantizedWeight(fmt, in_features, self._file.get_tensor(name)), native

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def load(path: Path) -> CachedChoices | None:
    """The choices saved at ``path``, or None without a readable file."""
    try:
        choices = CachedChoices(path)
        os.utime(path)  # in use: not stale
        return choices
    except (OSError, SafetensorError, ValueError, KeyError, TypeError):
        return None


def save(
    path: Path,
    choices: dict[str, Choice],
    packed: list[Entry] | None = None,
    kept: Collection[str] = (),
) -> None:
    """Write ``choices`` to ``path`` (a failure only logs: the cache is an optimisation). With
    ``packed``, the entries of the packed cache's file the load's weights are views of, only the
    records of ``kept`` are written (the weights the load reads itself: an embedding table not
    tied to a packed head), the others described: a GGUF's first start writes no second copy of
    its weights (on a VM, 0.4 s of Gemma 3 270M's), and a later start maps them from that file
    without reading records."""
    tensors = {
        name: w.records.contiguous()
        for name, (w, _) in choices.items()
        if w is not None and (packed is None or name in kept)
    }
    entries = {
        name: (None, 0, native, 0) if w is None else (w.fmt, w.in_features, native, w.out_features)
        for name, (w, native) in choices.items()
    }
    metadata = {"choices": json.dumps(entries)}
    if packed is not None:
        metadata["packed"] = json.dumps(packed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent, "*.safetensors")
        with replaced_atomically(path, ".safetensors") as temp:
            save_file(tensors, str(temp), metadata=metadata)
    except OSError as exc:
        log.warning("narrow weights not cached in %s: %s", path.parent, exc)
