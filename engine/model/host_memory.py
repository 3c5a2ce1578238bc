"""The C library calls a park needs and Python does not offer: handing pages of live memory back
to the OS, returning freed heap, starting a file range's writeback without waiting for it. Beside
park/ rather than in it: the runner and the narrow-weight load trim the heap too."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch

_PAGE = mmap.PAGESIZE
_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages back; return without waiting


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


@functools.cache
def _function(name: str, argtypes: tuple) -> ctypes._CFuncPtr | None:
    function = getattr(_libc(), name, None)
    if function is not None:
        function.argtypes = list(argtypes)
    return function


def raw_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``address`` that something else owns (and
    must keep alive while the tensor is used)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


def release_pages(address: int, nbytes: int) -> None:
    """Hand the whole pages inside ``nbytes`` at ``address`` back to the OS (``MADV_DONTNEED``):
    the allocation stays, its pages read as zeros until written again. Only for private
    anonymous memory whose contents are kept elsewhere; partial pages at the ends stay."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    madvise = _function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if madvise is not None and end > start:
        madvise(start, end - start, mmap.MADV_DONTNEED)


def trim_heap() -> None:
    """Return the heap's free memory to the OS (glibc's ``malloc_trim(0)``): freed weights
    smaller than glibc's mmap threshold sit in the heap otherwise, still counted in RSS."""
    trim = _function("malloc_trim", (ctypes.c_size_t,))
    if trim is not None:
        trim(0)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range's dirty pages to disk (Linux ``sync_file_range``), so they turn
    into clean pages the kernel can reclaim at no cost before anyone needs the memory."""
    sync = _function(
        "sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    )
    if sync is not None:
        sync(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
