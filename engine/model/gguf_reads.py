"""Faster reads of a GGUF's metadata for transformers' one-time conversion of its config and
tokenizer (engine.model.loader caches what it builds).

transformers reads the metadata with gguf's GGUFReader, once for the config and once more for the
tokenizer. The reader takes a few numpy views of the file's np.memmap per vocabulary string, and a
memmap's view costs several times a plain array's (memmap.__array_finalize__), seconds for a
large vocabulary. Inside `fast_gguf_reads` the reader views the mapping as a plain array and each
file is read once (figures: docs/PERFORMANCE.md#model-loading).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader


class PlainArrayReader(GGUFReader):
    """GGUFReader over a plain-array view of its mapping: the same fields and tensors."""

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        if type(self.data) is np.memmap:  # the first read, right after __init__ mapped the file
            self.data = self.data.view(np.ndarray)  # the mapping lives on as the view's base
        return super()._get(offset, dtype, count, override_order)


@contextlib.contextmanager
def fast_gguf_reads() -> Iterator[None]:
    """Within: ``gguf.GGUFReader(path)`` (which transformers looks up at each call) is a
    PlainArrayReader, one per file. Only for a single thread's conversion: the swap is global."""
    readers: dict[tuple[str, str], GGUFReader] = {}

    def read(path: os.PathLike[str] | str, mode: str = "r") -> GGUFReader:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)  # type: ignore[arg-type]
        return readers[key]

    original = gguf.GGUFReader
    gguf.GGUFReader = read  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
