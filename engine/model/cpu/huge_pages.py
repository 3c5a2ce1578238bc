"""CPU tensors carved from memory advised for transparent huge pages.

The panel GEMM streams every fp32 weight of the model once per decode step: on 4 KiB pages that is a
TLB miss every 4 KiB of weights, which 2 MiB pages spare (figures: docs/PERFORMANCE.md#huge-pages).
Only 2 MiB-aligned stretches of a mapping get huge pages, so small tensors share large mappings.
Where the kernel offers no THP for advised memory the advice changes nothing; the tensors are
ordinary memory either way.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

# Virtual size of a mapping: pages never written take no memory, so a large one costs nothing.
_CHUNK_BYTES = 1 << 30
_ALIGN = 4096


class HugePageArena:
    """Hands out uninitialised (zero) CPU tensors carved from private anonymous mappings advised
    ``MADV_HUGEPAGE``; each mapping lives as long as any tensor carved from it."""

    def __init__(self, chunk_bytes: int = _CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements, page-aligned."""
        nbytes = numel * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk = _advised_mapping(max(self._chunk_bytes, nbytes))
            self._used = 0
        out = self._chunk[self._used : self._used + nbytes].view(dtype)
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return out


def _advised_mapping(nbytes: int) -> torch.Tensor:
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system: plain memory
        return torch.zeros(nbytes, dtype=torch.uint8)
    # private: a shared anonymous mapping is shmem, which the advice does not give huge pages here
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE on this platform
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)
