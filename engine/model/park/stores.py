"""Where parked weights live: an unlinked file (CPU) or pinned host memory (CUDA).

Either store only grows: a weight is saved once, at the first park (weights never change), and
later parks point the tensors back at the bytes saved then. ``save`` returns one uint8 tensor per
source (its home), ``restore`` copies a home into memory on the model's device.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from engine.model.host_memory import start_writeback

_PAGE = 4096
_IO_CHUNK = 256 * 2**20  # bytes per read/write call (Linux moves at most ~2 GiB per call)


def aligned_offsets(sizes: list[int], align: int = _PAGE) -> tuple[list[int], int]:
    """Offsets of ``sizes`` laid out one after another on ``align`` boundaries, and the total."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    return offsets, end


class FileStore:
    """Parked bytes in a file under ``folder``, unlinked as soon as it is open (it vanishes with
    the process, even one killed mid-park), mapped shared: the homes are clean page-cache pages
    once written back (started at once), which the kernel may reclaim and reads back on demand.
    Saved bytes are written with ``pwrite`` and restored with ``preadv``, so neither direction
    faults the mapping's pages into this process."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._fd: int | None = None
        self._size = 0
        self._regions: list[tuple[int, int, mmap.mmap]] = []  # (address, file offset, mapping)

    def save(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        if not sources:
            return []
        offsets, total = aligned_offsets([s.numel() for s in sources])
        fd = self._file()
        start = self._size
        for source, offset in zip(sources, offsets, strict=True):
            _pwrite_all(fd, memoryview(source.numpy()), start + offset)
        self._size = start + total
        start_writeback(fd, start, total)
        mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, offset=start)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self._regions.append((whole.data_ptr(), start, mapping))
        return [whole[o : o + s.numel()] for s, o in zip(sources, offsets, strict=True)]

    def holds(self, address: int) -> bool:
        return self._file_offset(address) is not None

    def restore(self, home: torch.Tensor, dest: torch.Tensor) -> None:
        offset = self._file_offset(home.data_ptr())
        assert offset is not None and self._fd is not None, "not a home of this store"
        view, done = memoryview(dest.numpy()), 0
        while done < len(view):
            read = os.preadv(self._fd, [view[done : done + _IO_CHUNK]], offset + done)
            if read <= 0:
                raise OSError(f"park file ended {len(view) - done} bytes early")
            done += read

    def finish(self) -> None:
        """Drop the mapping's pages from this process: whatever read parked tensors while asleep
        (the engine runs nothing then; a test or a debugger might) faulted them in. The file
        keeps the bytes."""
        for _, _, mapping in self._regions:
            mapping.madvise(mmap.MADV_DONTNEED)

    def _file(self) -> int:
        if self._fd is None:
            try:
                self._folder.mkdir(parents=True, exist_ok=True)
                fd, path = tempfile.mkstemp(dir=self._folder, prefix=f"park-{os.getpid()}-")
            except OSError:  # an unwritable cache root: the system's temp folder
                fd, path = tempfile.mkstemp(prefix=f"modelyard-park-{os.getpid()}-")
            os.unlink(path)
            self._fd = fd
        return self._fd

    def _file_offset(self, address: int) -> int | None:
        for base, offset, mapping in self._regions:
            if base <= address < base + len(mapping):
                return offset + address - base
        return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _IO_CHUNK], offset + done)


class PinnedStore:
    """Parked bytes of a CUDA model in page-locked host memory, so the copies both ways run at
    the bus's speed (untested here: no GPU on the development machines)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def save(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        if not sources:
            return []
        offsets, total = aligned_offsets([s.numel() for s in sources])
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self._buffers.append(buffer)
        homes = [buffer[o : o + s.numel()] for s, o in zip(sources, offsets, strict=True)]
        for home, source in zip(homes, sources, strict=True):
            home.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        return homes

    def holds(self, address: int) -> bool:
        return any(b.data_ptr() <= address < b.data_ptr() + b.numel() for b in self._buffers)

    def restore(self, home: torch.Tensor, dest: torch.Tensor) -> None:
        dest.copy_(home, non_blocking=True)

    def finish(self) -> None:
        torch.cuda.synchronize()


ParkStore = FileStore | PinnedStore


def store_for(device: torch.device, folder: Path) -> ParkStore:
    return PinnedStore() if device.type == "cuda" else FileStore(folder)
