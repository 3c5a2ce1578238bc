"""A model's tokenizer as an engine keeps it, built once per process and folder.

The Rust library builds Gemma 3's 262,144-token tokenizer from its tokenizer.json in 1-1.5 s and
keeps ~90 MiB of it. An engine template (engine.template.tokenizers) builds the tokenizer of a
converted GGUF before it forks that model's engine: the engine finds it kept here, built, and
shares its pages with the template and with every other engine of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

TOKENIZER_FILE = "tokenizer.json"

# folder -> (its tokenizer.json's size and mtime when built, the tokenizer)
_kept: dict[Path, tuple[tuple[int, int], Any]] = {}


def kept_tokenizer(folder: Path) -> tuple[Any, bool]:
    """(the shareable tokenizer converted into ``folder``, whether this process had built it
    already: in an engine forked from a template, the template did)."""
    key, identity = folder.resolve(), _identity(folder)
    kept = _kept.get(key)
    if kept is not None and kept[0] == identity:
        return kept[1], True
    tokenizer = shareable_tokenizer(converted_tokenizer(folder))
    _kept[key] = (identity, tokenizer)
    return tokenizer, False


def forget(folder: Path) -> None:
    """Drop this process's tokenizer of ``folder`` (its memory goes once nothing else holds it)."""
    _kept.pop(folder.resolve(), None)


def _identity(folder: Path) -> tuple[int, int]:
    stat = (folder / TOKENIZER_FILE).stat()
    return stat.st_size, stat.st_mtime_ns


def converted_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer engine.model.loader converted into ``folder``, built by the Rust library
    straight from its tokenizer.json. AutoTokenizer would parse that JSON in Python too and
    rebuild the Rust tokenizer from its vocabulary through the family's class (GemmaTokenizer,
    ...), whose code only runs at such a construction: what it built is what the file holds.
    Seconds less for a large vocabulary (docs/PERFORMANCE.md#model-loading)."""
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    if template.is_file():
        settings["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), **settings)


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
