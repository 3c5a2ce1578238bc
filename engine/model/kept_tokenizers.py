"""A model's tokenizer as an engine keeps it, built once per process and folder.

The Rust library builds Gemma 3's 262,144-token tokenizer from its tokenizer.json in 1-1.5 s and
keeps ~90 MiB of it. An engine template (engine.template.tokenizers) builds the tokenizer of a
converted GGUF before it forks that model's engine: the engine finds it kept here, built, and
shares its pages with the template and with every other engine of the same file. An engine that
converts a GGUF itself (its first start) keeps the tokenizer the conversion built (`keep_built`)
instead of reading back the tokenizer.json it has just written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

TOKENIZER_FILE = "tokenizer.json"

# what a tokenizer was built from: its tokenizer.json, or the conversion that wrote that file
FROM_FILE, FROM_CONVERSION = "tokenizer.json", "conversion"


@dataclass
class _Kept:
    identity: tuple[int, int]  # the tokenizer.json's size and mtime when built
    tokenizer: Any
    built_from: str  # FROM_FILE or FROM_CONVERSION


_kept: dict[Path, _Kept] = {}  # by folder


def kept_tokenizer(folder: Path) -> tuple[Any, str | None]:
    """(the shareable tokenizer converted into ``folder``, what it was built from where this
    process had built it already, else None): in an engine forked from a template, the template
    built it from the file; in an engine that converted the GGUF, the conversion built it."""
    key, identity = folder.resolve(), _identity(folder)
    kept = _kept.get(key)
    if kept is not None and kept.identity == identity:
        return kept.tokenizer, kept.built_from
    tokenizer = shareable_tokenizer(converted_tokenizer(folder))
    _kept[key] = _Kept(identity, tokenizer, FROM_FILE)
    return tokenizer, None


def keep_built(folder: Path, backend: Tokenizer) -> None:
    """Keep, as ``folder``'s tokenizer, the one around ``backend``: the Rust tokenizer whose
    serialisation is ``folder``'s tokenizer.json, built by the conversion that wrote it."""
    tokenizer = shareable_tokenizer(converted_tokenizer(folder, backend))
    _kept[folder.resolve()] = _Kept(_identity(folder), tokenizer, FROM_CONVERSION)


def forget(folder: Path) -> None:
    """Drop this process's tokenizer of ``folder`` (its memory goes once nothing else holds it)."""
    _kept.pop(folder.resolve(), None)


def _identity(folder: Path) -> tuple[int, int]:
    stat = (folder / TOKENIZER_FILE).stat()
    return stat.st_size, stat.st_mtime_ns


def converted_tokenizer(folder: Path, backend: Tokenizer | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer engine.model.loader converted into ``folder``, built by the Rust library
    straight from its tokenizer.json, or around ``backend``, that file's tokenizer already built.
    AutoTokenizer would parse that JSON in Python too and rebuild the Rust tokenizer from its
    vocabulary through the family's class (GemmaTokenizer, ...), whose code only runs at such a
    construction: what it built is what the file holds. Seconds less for a large vocabulary
    (docs/PERFORMANCE.md#model-loading)."""
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    if template.is_file():
        settings["chat_template"] = template.read_text()
    if backend is None:
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), **settings)
    # transformers deep-copies a `tokenizer_object` (a JSON round trip, as slow as the file); a
    # backend set before __init__ is its hook for classes that build their own, taken as it is
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    PreTrainedTokenizerFast.__init__(tokenizer, **settings)
    return tokenizer


def shareable_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as the engine keeps it: shared by its threads (detokenising, templates and
    tokenising, the event loop) instead of a copy each (a copy of Gemma's 262,144-token tokenizer
    took 3.5 s and ~400 MB), and without the vocabulary and merges that transformers' model
    tokenizer classes keep as Python objects after building the Rust tokenizer from them (170 MB
    for Gemma's; the Rust tokenizer holds its own). The Rust tokenizer refuses concurrent calls
    only when one of them changes it ("Already borrowed"): transformers does that only to switch
    truncation or padding to what a call asks, so both start (and, as the engine never asks for
    either, stay) off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        for construction_only in ("_vocab", "_merges"):
            if construction_only in vars(tokenizer):
                delattr(tokenizer, construction_only)
    return tokenizer
