"""The tokenizers an engine template builds for the engines it forks.

Before it forks an engine of a GGUF converted before, the template builds that file's tokenizer
(engine.model.kept_tokenizers): the engine finds it built, skips the 1-1.5 s Gemma 3's takes,
and every engine of the file shares the template's copy (~90 MiB for Gemma's) instead of holding
its own. A tokenizer stays while an engine forked with it lives. Once none does, it stays while
the unused ones' memory is within UNUSED_BYTES, least recently used dropped first: the next start
of a model that was stopped (evicted, idle, crashed) finds it too, and the template's memory,
which the gateway counts against its budget, stays bounded. The gateway also names its on-demand
models' engines to a template once it is ready, whose tokenizers it then builds while idle and
while the unused ones fit (`prepare_ahead`): a model's first start in the gateway's life finds
its tokenizer built as well.

A file never converted (its first start converts it, in the engine) and a model folder's
tokenizer (AutoTokenizer, not a converted tokenizer.json) are left to the engine.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.processes import rss_bytes
from engine.errors import ModelLoadError
from engine.model.host_memory import trim_heap
from engine.model.kept_tokenizers import forget, kept_tokenizer
from engine.model.loader import known_gguf_dir
from engine.model.model_source import split_source
from engine.serving.cli import model_flags

UNUSED_BYTES = 256 * 2**20


@dataclass
class _Shelved:
    nbytes: int  # what building it added to the template's resident memory
    engines: set[int] = field(default_factory=set)  # live engines forked with it
    last_used: float = 0.0


class TokenizerShelf:
    def __init__(self, unused_bytes: int = UNUSED_BYTES) -> None:
        self.unused_bytes = unused_bytes
        self._shelved: dict[Path, _Shelved] = {}
        self._engines: dict[int, Path] = {}

    def prepare(self, argv: list[str], cwd: str | None) -> tuple[Path | None, str | None]:
        """Builds (or finds) the tokenizer of the engine ``argv`` starts; its folder (None where
        the engine builds its own) and a line for the template's log, if any."""
        folder = _converted_folder(argv, cwd)
        if folder is None:
            return None, None
        if folder in self._shelved:
            self._shelved[folder].last_used = time.monotonic()
            return folder, None
        began, before = time.monotonic(), rss_bytes() or 0
        try:
            kept_tokenizer(folder)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            return None, f"tokenizer in {folder} not built (its engine builds it): {error}"
        _give_back()  # what building left for the collector, before the engines fork
        nbytes = max(0, (rss_bytes() or 0) - before)
        self._shelved[folder] = _Shelved(nbytes, last_used=time.monotonic())
        took = time.monotonic() - began
        return folder, f"tokenizer in {folder} built for its engines: {took:.2f}s, {_mib(nbytes)}"

    def prepare_ahead(self, argv: list[str], cwd: str | None) -> str | None:
        """Builds the tokenizer of an engine the gateway may start later (an on-demand model's)
        while the unused ones stay within ``unused_bytes``, so that its first start in the
        gateway's life finds it built; a line for the template's log, if any."""
        if self._unused_bytes() >= self.unused_bytes:
            return None
        folder, line = self.prepare(argv, cwd)
        if folder is None or line is None:  # none to build, or built already
            return line
        if self._unused_bytes() > self.unused_bytes:  # no room: nothing used more lately goes
            self._drop(folder)
            _give_back()
            return f"{line}, dropped again: the unused ones would pass {_mib(self.unused_bytes)}"
        return f"{line}, ahead of its first start"

    def forked(self, pid: int, folder: Path | None) -> None:
        if folder is not None and folder in self._shelved:
            self._shelved[folder].engines.add(pid)
            self._engines[pid] = folder

    def exited(self, pid: int) -> list[str]:
        """Forgets the engine ``pid``; drops what unused tokenizers exceed the bound, and says
        which."""
        folder = self._engines.pop(pid, None)
        if folder is not None:
            shelved = self._shelved[folder]
            shelved.engines.discard(pid)
            shelved.last_used = time.monotonic()
        return self.drop_unused()

    def drop_unused(self) -> list[str]:
        """Drops the least recently used tokenizers no engine uses until the unused ones fit in
        ``unused_bytes``; a line for each."""
        unused = sorted(
            (shelved.last_used, folder)
            for folder, shelved in self._shelved.items()
            if not shelved.engines
        )
        held = sum(self._shelved[folder].nbytes for _, folder in unused)
        dropped = []
        for _, folder in unused:
            if held <= self.unused_bytes:
                break
            held -= self._drop(folder)
            dropped.append(f"tokenizer in {folder} dropped: no engine uses it")
        if dropped:
            _give_back()
        return dropped

    def _drop(self, folder: Path) -> int:
        """Forgets the tokenizer of ``folder`` (its memory goes at the next `_give_back`); what
        it held."""
        nbytes = self._shelved.pop(folder).nbytes
        forget(folder)
        return nbytes

    def _unused_bytes(self) -> int:
        return sum(shelved.nbytes for shelved in self._shelved.values() if not shelved.engines)

    def held_bytes(self) -> int:
        return sum(shelved.nbytes for shelved in self._shelved.values())


def _converted_folder(argv: list[str], cwd: str | None) -> Path | None:
    """The converted GGUF folder of the engine ``argv`` starts in ``cwd``; None where it names
    no GGUF, or one never converted."""
    flags = model_flags(argv)
    if flags is None:
        return None
    model, gguf_file = flags
    path = Path(model).expanduser()
    if cwd and not path.is_absolute():
        path = Path(cwd) / path
    try:
        folder, name = split_source(str(path), gguf_file)
        return known_gguf_dir(folder / name) if name else None
    except (ModelLoadError, OSError):
        return None


def _give_back() -> None:
    """Collect what tokenizers left and return the freed heap to the OS."""
    gc.collect()
    trim_heap()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"
