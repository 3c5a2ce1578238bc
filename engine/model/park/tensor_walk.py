"""Every tensor a set of root objects holds, the memory extents they occupy, and repointing them.

The walk follows modules (parameters, buffers, submodules and their other attributes),
lists, tuples, sets, dict values, the engine's own objects (classes defined under ``engine.``:
the lean forward and its layer tables, the CPU fast path) and a view's base (which a view keeps
alive). It follows nothing else (transformers configs, tokenizers, ctypes libraries, closures):
a tensor that only such an object holds is not found, and its memory is not released.

An extent is a stretch of one storage that found tensors overlap: views of one tensor, tensors
sharing a storage at overlapping offsets. Repointing all tensors of an extent to one new stretch
of the same length, at the same relative offsets and strides, keeps their sharing: a view stays a
view of its base. Parts of a storage that no found tensor covers (an arena's unused tail) are
neither copied nor kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

# Extents start on this boundary (bytes) within their storage, so a copy at an address with the
# same alignment keeps every tensor's alignment for vector loads.
ALIGN = 64


@dataclass
class Extent:
    """Bytes [lo, hi) of ``storage`` and the tensors whose elements lie in them."""

    storage: torch.UntypedStorage
    lo: int
    hi: int
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def address(self) -> int:
        return self.storage.data_ptr() + self.lo

    def as_bytes(self) -> torch.Tensor:
        """The extent's bytes as a uint8 tensor (a view, no copy)."""
        return _on(self.storage, torch.uint8, self.lo, (self.nbytes,), (1,))


@dataclass
class Walk:
    extents: list[Extent]
    empty: list[torch.Tensor]  # tensors without elements: they need no bytes, only a new storage


def find_tensors(roots: Iterable[object]) -> list[torch.Tensor]:
    """Every distinct tensor object reachable from ``roots`` (see the module docstring)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
            stack.append(obj._base)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, nn.Module) or _is_engine_object(obj):
            stack.extend(vars(obj).values())
    return list(found.values())


def _is_engine_object(obj: object) -> bool:
    return hasattr(obj, "__dict__") and type(obj).__module__.startswith("engine.")


def walk(roots: Iterable[object], device: torch.device) -> Walk:
    """The extents of the strided tensors on ``device`` reachable from ``roots``."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    empty = []
    for tensor in find_tensors(roots):
        if tensor.layout != torch.strided or tensor.device != device:
            continue
        if tensor.numel() == 0:
            empty.append(tensor)
        else:
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    extents = []
    for tensors in by_storage.values():
        storage = max((t.untyped_storage() for t in tensors), key=lambda s: s.nbytes())
        extents += _extents_of(storage, tensors)
    return Walk(extents, empty)


def _extents_of(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> list[Extent]:
    """Tensors of one storage merged into extents where their (aligned) byte ranges overlap."""
    ranges = sorted((*_byte_range(t), id(t), t) for t in tensors)
    extents: list[Extent] = []
    for lo, hi, _, tensor in ranges:
        lo -= lo % ALIGN
        if extents and lo < extents[-1].hi:
            extents[-1].hi = max(extents[-1].hi, hi)
        else:
            extents.append(Extent(storage, lo, hi))
        extents[-1].tensors.append(tensor)
    return extents


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """Bytes [lo, hi) of its storage that a non-empty tensor's elements span."""
    size = tensor.element_size()
    lo = tensor.storage_offset() * size
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return lo, lo + (last + 1) * size


def repoint(extent: Extent, home: torch.Tensor) -> None:
    """Point every tensor of ``extent`` at the same bytes in ``home`` (uint8, ``extent.nbytes``
    long, any device): same relative offsets, shapes and strides. In place (``t.data = ...``),
    so every reference to the tensor sees the move; the old storage is freed once nothing else
    holds it."""
    storage = home.untyped_storage()
    base = home.storage_offset() - extent.lo
    for tensor in extent.tensors:
        size = tensor.element_size()
        offset = base + tensor.storage_offset() * size
        assert offset % size == 0, "extents keep element alignment"
        tensor.data = _on(storage, tensor.dtype, offset // size, tensor.shape, tensor.stride())


def repoint_empty(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Give tensors without elements a fresh (empty) storage on ``device``."""
    for tensor in tensors:
        tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def _on(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    shape: tuple[int, ...] | torch.Size,
    stride: tuple[int, ...],
) -> torch.Tensor:
    """A tensor of ``dtype`` over ``storage`` at element ``offset``."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
