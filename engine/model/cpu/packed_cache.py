"""Narrow weights in their kernels' layout, cached per records' cache file and kernel build, and
mapped rather than read.

The records (engine.model.cpu.narrow_cache) still have to be packed into the layout the GEMMs
read: 0.2 s and ~260 MB of private memory per engine of Gemma 3 270M. The first start writes the
packed buffers into one file; every later start maps it copy-on-write (never written) and hands
its ranges to the modules: nothing to pack, and every engine of the file reads the same
page-cache pages, its PSS counting a share, as llama.cpp's processes share a GGUF's pages. A park
drops the process's pages of the file (it holds the bytes already); a wake faults them back.

A file: ``MAGIC``, the index's length (8 bytes, little-endian), the index (JSON: one
``[format, n, k, offset, nbytes]`` per packed weight, in the order the load builds them), then
each buffer at a page-aligned offset. An entry that does not match what the load builds (format,
shape) makes the load pack everything and write the file again; a file cut short is ignored.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

from engine.model.cache_dir import remove_stale, replaced_atomically
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.quant_formats import QuantizedWeight

log = logging.getLogger(__name__)

MAGIC = b"MYPACK01"
_PAGE = 4096
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; 3.11 lacks the name

Entry = tuple[str, int, int]  # a packed weight's format, n (outputs), k (inputs)


def cache_path(records: Path, lib: ctypes.CDLL) -> Path:
    """The packed file of the records' cache file ``records`` under kernel library ``lib`` (its
    file name carries its build's content hash, so a kernel change means a new file)."""
    ident = f"{records.name}|{Path(lib._name).name}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return records.parent.parent / "packed" / f"{key}.bin"


class MappedFile:
    """A packed file mapped copy-on-write: its pages are the page cache's, shared with every
    process that maps the file, and no write ever copies them."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            self._map = mmap.mmap(
                f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        try:
            self.entries = _index(self._map)
        except (ValueError, KeyError, TypeError):
            self._map.close()
            raise
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address, self.nbytes = whole.data_ptr(), whole.numel()
        self._views = [whole[offset : offset + size] for *_, offset, size in self.entries]

    def view(self, index: int) -> torch.Tensor:
        """The bytes of entry ``index`` (a view that keeps the mapping alive)."""
        return self._views[index]

    def matches(self, index: int, entry: Entry) -> bool:
        return index < len(self.entries) and tuple(self.entries[index][:3]) == entry

    def holds(self, address: int) -> bool:
        return self.address <= address < self.address + self.nbytes

    def release(self) -> None:
        """Drop this process's pages of the file (the page cache keeps them for the others)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def populate(self) -> None:
        """Map every page of the file again, read-only (still the page cache's): the first step
        after a wake then faults nothing, and the engine's measured memory counts them at once.
        A kernel before Linux 5.14 has no such advice: its steps fault them in as they read."""
        with contextlib.suppress(OSError):
            self._map.madvise(_MADV_POPULATE_READ)


def _index(mapping: mmap.mmap) -> list[list]:
    if mapping[: len(MAGIC)] != MAGIC:
        raise ValueError("not a packed-weights file")
    start = len(MAGIC) + 8
    length = int.from_bytes(mapping[len(MAGIC) : start], "little")
    entries = json.loads(mapping[start : start + length])
    for fmt, _, _, offset, nbytes in entries:
        if not (isinstance(fmt, str) and offset % _PAGE == 0 and offset + nbytes <= len(mapping)):
            raise ValueError("a packed-weights entry outside its file")
    return entries


def open_mapped(path: Path) -> MappedFile | None:
    """The packed file at ``path`` mapped, or None without a complete one."""
    try:
        mapped = MappedFile(path)
        os.utime(path)  # in use: not stale
        return mapped
    except (OSError, ValueError, KeyError, TypeError):
        return None


class PackedSlots:
    """The packed weights of one load, in the order its QuantizedLinears are built: each a view
    of the cached file where its entry matches, else packed here. `finish` writes the file when
    any was packed and points every module at it; the load then holds no private copy."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None) -> None:
        self._lib, self.path = lib, path
        self.mapped = open_mapped(path) if path is not None else None
        self._built: list[tuple[nn.Module, Entry, torch.Tensor]] = []
        self._packed_here = 0

    def pack(self, module: nn.Module, weight: QuantizedWeight) -> torch.Tensor:
        """``weight`` in the kernel's layout for ``module``, which keeps it as ``packed``."""
        entry = (weight.fmt, weight.out_features, weight.in_features)
        index = len(self._built)
        if self.mapped is not None and self.mapped.matches(index, entry):
            packed = self.mapped.view(index)
        else:
            packed = quant_gemm.pack(self._lib, weight)
            self._packed_here += 1
        self._built.append((module, entry, packed))
        return packed

    def finish(self) -> MappedFile | None:
        """The file every module's weight is a view of now (written first where the load packed
        any), or None where it cannot be written (the modules keep their own buffers)."""
        if not self._built:
            return None
        mapped = self.mapped
        if mapped is not None and not self._packed_here and len(mapped.entries) == len(self._built):
            return mapped
        if self.path is None:
            return None
        try:
            _write(self.path, [(entry, packed) for _, entry, packed in self._built])
        except OSError as exc:
            log.warning("packed weights not cached in %s: %s", self.path.parent, exc)
            return None
        mapped = open_mapped(self.path)
        if mapped is None:
            return None
        for index, (module, _, _) in enumerate(self._built):
            module.packed = mapped.view(index)
        return mapped


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


def _write(path: Path, weights: list[tuple[Entry, torch.Tensor]]) -> None:
    """The file, under a temporary name then renamed: readers see no file or a complete one."""
    relative, end = [], 0
    for (fmt, n, k), packed in weights:
        relative.append([fmt, n, k, end, packed.numel()])
        end += _pages(packed.numel())
    data_start = 0
    while True:  # the index's length grows with the offsets it holds: until they agree
        entries = [[fmt, n, k, data_start + at, size] for fmt, n, k, at, size in relative]
        header = MAGIC + b"\0" * 8 + json.dumps(entries).encode()
        if len(header) <= data_start:
            break
        data_start = _pages(len(header))
    index = header[len(MAGIC) + 8 :]
    header = MAGIC + len(index).to_bytes(8, "little") + index
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, "*.bin")
    with replaced_atomically(path, ".bin") as temp, temp.open("wb") as f:
        f.write(header)
        for (_, _, _, start, _), (_, packed) in zip(entries, weights, strict=True):
            f.seek(start)
            f.write(memoryview(packed.contiguous().numpy()))
        f.truncate(data_start + end)
