"""Narrow weights in their kernels' layout, cached per records' cache file and kernel build, and
mapped rather than read.

Packing records into the layout the GEMMs read took 0.2 s and ~260 MB of private memory per
engine of Gemma 3 270M. The first start packs them into one file; every later start maps it
copy-on-write (never written) and hands its ranges to the modules: nothing to pack, and every
engine of the file reads the same page-cache pages, its PSS counting a share, as llama.cpp's
processes share a GGUF's pages (the records' cache then only describes those weights:
engine.model.cpu.narrow_cache). A park drops the process's pages of the file (it holds the bytes
already); a wake faults them back.

A file: a page holding ``MAGIC`` and the index's offset and length (8 bytes each,
little-endian); each buffer at a page-aligned offset; then the index (JSON: one ``[format, n, k,
offset, nbytes]`` per packed weight, in the order the load builds them), written last. A load
packs into a new file's pages as it goes (`_NewFile`). An entry that does not match what the
load builds (format, shape) makes the load write the file again; a file cut short is ignored.
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

MAGIC = b"MYPACK02"
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
        # each entry's format and shape, in the load's order
        self.layout: list[Entry] = [(fmt, n, k) for fmt, n, k, _, _ in self.entries]
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address, self.nbytes = whole.data_ptr(), whole.numel()
        self._views = [whole[offset : offset + size] for *_, offset, size in self.entries]

    def view(self, index: int) -> torch.Tensor:
        """The bytes of entry ``index`` (a view that keeps the mapping alive)."""
        return self._views[index]

    def matches(self, index: int, entry: Entry) -> bool:
        return index < len(self.layout) and self.layout[index] == entry

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
    at = int.from_bytes(mapping[len(MAGIC) : len(MAGIC) + 8], "little")
    length = int.from_bytes(mapping[len(MAGIC) + 8 : len(MAGIC) + 16], "little")
    if at + length > len(mapping):
        raise ValueError("a packed-weights index outside its file")
    entries = json.loads(mapping[at : at + length])
    for fmt, _, _, offset, nbytes in entries:
        if not (isinstance(fmt, str) and offset % _PAGE == 0 and offset + nbytes <= at):
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
    of the cached file where its entry matches, else packed here, straight into a new file's
    pages (the entries before it copied there) or, without one, into a buffer of its own.
    `finish` completes the new file and points every module at it: the load then holds no
    private copy. Call `abandon` where the load fails before `finish`."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None) -> None:
        self._lib, self.path = lib, path
        self.mapped = open_mapped(path) if path is not None else None
        self._built: list[tuple[nn.Module, Entry, torch.Tensor]] = []
        self._new: _NewFile | None = None
        self._unwritable = path is None  # no file to write: own buffers

    def maps(self, entries: list[Entry]) -> bool:
        """Whether the cached file holds exactly ``entries``, in that order."""
        return self.mapped is not None and self.mapped.layout == entries

    def pack(self, module: nn.Module, weight: QuantizedWeight) -> torch.Tensor:
        """``weight`` in the kernel's layout for ``module``, which keeps it as ``packed``."""
        entry = (weight.fmt, weight.out_features, weight.in_features)
        index = len(self._built)
        if self._new is None and self.mapped is not None and self.mapped.matches(index, entry):
            packed = self.mapped.view(index)
        elif weight.records.is_meta:
            raise ValueError(f"a described {entry} weight that the packed file does not hold")
        else:
            slot = self._slot(entry, quant_gemm.packed_bytes(self._lib, weight))
            packed = quant_gemm.pack(self._lib, weight, slot)
        self._built.append((module, entry, packed))
        return packed

    def finish(self) -> MappedFile | None:
        """The file every module's weight is a view of now (completed first where the load
        packed any, or rewritten where it holds more entries than the load built), or None where
        it cannot be written (the modules keep buffers of their own)."""
        try:
            return self._finish()
        finally:
            self._built = []  # the new file's own mappings go with the last view of them

    def _finish(self) -> MappedFile | None:
        mapped = self.mapped
        if not self._built or self._unwritable:
            return None
        if self._new is None and mapped is not None and len(mapped.layout) == len(self._built):
            return mapped
        if self._new is None:  # an entry too many: the file written again without it
            self._start_new_file()
            if self._new is None:
                return None
        new, self._new = self._new, None
        try:
            new.complete()
            mapped = open_mapped(new.path)
        except OSError as exc:
            new.remove()
            self._give_up(exc)
            return None
        if mapped is None:
            self._own_buffers()
            return None
        for index, (module, _, _) in enumerate(self._built):
            module.packed = mapped.view(index)
        return mapped

    def abandon(self) -> None:
        """Remove the new file, unfinished (the load failed)."""
        if self._new is not None:
            self._new.remove()
            self._new = None

    def _slot(self, entry: Entry, nbytes: int) -> torch.Tensor | None:
        """Where to pack an entry of ``nbytes``: the new file's pages, or None (a buffer)."""
        if self._new is None and not self._unwritable:
            self._start_new_file()
        if self._new is None:
            return None
        try:
            return self._new.slot(entry, nbytes)
        except OSError as exc:
            self._give_up(exc)
            return None

    def _start_new_file(self) -> None:
        """A new file, holding the entries built so far (copied from the old one)."""
        assert self.path is not None
        try:
            self._new = _NewFile(self.path)
            for _, entry, packed in self._built:
                self._new.slot(entry, packed.numel()).copy_(packed)
        except OSError as exc:
            self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        log.warning("packed weights not cached in %s: %s", self.path.parent, exc)
        self._unwritable = True
        self.abandon()
        self._own_buffers()

    def _own_buffers(self) -> None:
        """Every module's weight in a buffer of its own: none is a view of a file that a park
        could take for the cached one (the new file is removed, or never renamed into place)."""
        for at, (module, entry, packed) in enumerate(self._built):
            own = packed.clone()
            module.packed = own
            self._built[at] = (module, entry, own)


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


class _NewFile:
    """A packed file being written under a temporary name: each weight packed straight into its
    pages through a shared mapping (no buffer of the process's own, then a copy into the page
    cache: on a VM each is a fresh page's fault, 0.4 s of Gemma's first start), its blocks
    reserved first so that a full disk is an OSError here, never a SIGBUS on a page. `complete`
    writes the index after the weights and the header before them, then renames the file into
    place: readers see no file or a complete one."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent, "*.bin")
        self.path = path
        self._files = contextlib.ExitStack()
        temp = self._files.enter_context(replaced_atomically(path, ".bin"))
        self._file = self._files.enter_context(temp.open("r+b"))
        self._entries: list[list] = []
        self._end = _PAGE  # the header's page, then the weights

    def slot(self, entry: Entry, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the file's pages for ``entry``, page-aligned, mapped writable."""
        offset, size = self._end, _pages(max(nbytes, 1))
        os.posix_fallocate(self._file.fileno(), offset, size)
        pages = mmap.mmap(self._file.fileno(), size, flags=mmap.MAP_SHARED, offset=offset)
        self._entries.append([*entry, offset, nbytes])
        self._end += size
        return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes]

    def complete(self) -> None:
        index = json.dumps(self._entries).encode()
        self._file.seek(self._end)
        self._file.write(index)
        self._file.seek(0)
        self._file.write(MAGIC + self._end.to_bytes(8, "little") + len(index).to_bytes(8, "little"))
        self._file.flush()
        self._files.close()  # closed, then renamed

    def remove(self) -> None:
        self._files.__exit__(OSError, OSError("abandoned"), None)  # closed, then removed
