"""`WeightParker`: a model's weights out of process memory (park) and back (wake), in place.

Park: the tensors reachable from the runner's roots (engine.model.park.tensor_walk) are grouped
into extents; each extent's bytes go to the store (engine.model.park.stores) the first time, and
every tensor is repointed at its home there, so its anonymous memory is freed. Wake: every parked
extent is copied into one fresh mapping advised for huge pages (the panel GEMM's weights keep
their 2 MiB pages, engine.model.cpu.huge_pages) or, on CUDA, one device buffer, and the tensors
are repointed there. What a wake restored is remembered by address, so the next park points the
tensors back at their homes without writing anything.

oneDNN's prepacked weights are opaque tensors (no storage to repoint, and rebuilding one costs
a reorder at ~0.5 GB/s): they keep their allocation, their bytes are saved like an extent, their
pages are handed back to the OS (MADV_DONTNEED; they read as zeros while parked, when nothing
runs) and refilled from the store on wake.

Weights are read-only: a tensor written in place between a wake and the next park would be parked
with its old bytes. Tensors that appear after the first park (a rotary table grown for longer
positions) are found by the walk and saved then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.model.cpu.huge_pages import HugePageArena
from engine.model.cpu.linear import PrepackedLinear
from engine.model.cpu.packed_cache import MappedFile
from engine.model.host_memory import raw_bytes, release_pages
from engine.model.park.stores import aligned_offsets, store_for
from engine.model.park.tensor_walk import Extent, repoint, repoint_empty, walk

_HOST = torch.device("cpu")  # where both stores keep the parked bytes


@dataclass(frozen=True)
class Moved:
    """One park or wake: weight bytes in process memory before and after, bytes copied."""

    resident_before: int
    resident_after: int
    copied: int


class WeightParker:
    """Parks and wakes the weights of the objects in ``roots`` (modules and the engine's objects
    that hold weights), which live on ``device``; parked bytes go to a file under ``folder``
    (CPU) or pinned host memory (CUDA). Weights that are views of a ``mapped`` file (the packed
    cache's) are home already: a park only drops the process's pages of it, a wake copies nothing
    (it maps them back from the page cache)."""

    def __init__(
        self,
        roots: list[object],
        device: torch.device,
        folder: Path,
        mapped: MappedFile | None = None,
    ) -> None:
        self._roots = roots
        self._device = device
        self._store = store_for(device, folder)
        self._mapped = mapped
        # what the last wake restored: its address -> (bytes, home in the store)
        self._awake: dict[int, tuple[int, torch.Tensor]] = {}
        # oneDNN weights saved so far: their module -> (the opaque tensor, its bytes' home)
        self._opaque: dict[PrepackedLinear, tuple[torch.Tensor, torch.Tensor]] = {}
        self._empty: list[torch.Tensor] = []  # tensors without elements the last park moved
        self.parked = False

    def resident_bytes(self) -> int:
        """Bytes of weights in process (device) memory now."""
        if self.parked:
            return 0
        extents = walk(self._roots, self._device).extents
        opaque = sum(_raw(packed).numel() for _, packed in self._onednn_weights())
        return sum(e.nbytes for e in extents if not self._store.holds(e.address)) + opaque

    def park(self) -> Moved:
        """Move every weight out of process memory (no-op when parked). Memory freed from
        glibc's heap stays counted until the caller trims it (host_memory.trim_heap), once it
        has freed the rest (the runner: the KV pools)."""
        if self.parked:
            return Moved(0, 0, 0)
        found = walk(self._roots, self._device)
        moving = [e for e in found.extents if not self._at_home(e.address)]
        homes = {id(e): self._known_home(e) for e in moving}
        new = [e for e in moving if homes[id(e)] is None]
        opaque = self._onednn_weights()
        unsaved = [(m, p) for m, p in opaque if self._opaque.get(m, (None,))[0] is not p]
        sources = [e.as_bytes() for e in new] + [_raw(p) for _, p in unsaved]
        saved = self._store.save(sources)  # the only step that can fail (disk full): do it first
        homes.update((id(e), home) for e, home in zip(new, saved[: len(new)], strict=True))
        self._opaque.update(
            (m, (p, home)) for (m, p), home in zip(unsaved, saved[len(new) :], strict=True)
        )
        for extent in moving:
            repoint(extent, homes[id(extent)])
        repoint_empty(found.empty, _HOST)
        self._empty = found.empty
        for _, packed in opaque:
            raw = _raw(packed)
            release_pages(raw.data_ptr(), raw.numel())
        mapped = [e for e in found.extents if self._in_mapped(e.address)]
        if self._mapped is not None:
            self._mapped.release()
        resident = sum(e.nbytes for e in (*moving, *mapped))
        resident += sum(_raw(p).numel() for _, p in opaque)
        written = sum(s.numel() for s in sources)
        self._awake.clear()
        self.parked = True
        return Moved(resident, 0, written)

    def wake(self) -> Moved:
        """Copy every parked weight back into process memory (no-op when awake)."""
        if not self.parked:
            return Moved(0, 0, 0)
        found = walk(self._roots, _HOST)
        parked = [e for e in found.extents if self._store.holds(e.address)]
        dests = self._destinations([e.nbytes for e in parked])
        for extent, dest in zip(parked, dests, strict=True):
            self._store.restore(extent.as_bytes(), dest)
        for packed, home in self._opaque.values():
            self._store.restore(home, _raw(packed))
        self._store.finish()
        if self._mapped is not None:
            self._mapped.populate()
        for extent, dest in zip(parked, dests, strict=True):
            self._awake[dest.data_ptr()] = (extent.nbytes, extent.as_bytes())
            repoint(extent, dest)
        repoint_empty(self._empty, self._device)
        self.parked = False
        copied = sum(d.numel() for d in dests) + sum(h.numel() for _, h in self._opaque.values())
        return Moved(0, copied, copied)

    def _at_home(self, address: int) -> bool:
        """Whether the bytes at ``address`` are in the store or the mapped file already."""
        return self._store.holds(address) or self._in_mapped(address)

    def _in_mapped(self, address: int) -> bool:
        return self._mapped is not None and self._mapped.holds(address)

    def _known_home(self, extent: Extent) -> torch.Tensor | None:
        """The home of an extent the last wake restored, unchanged since (same place, size)."""
        known = self._awake.get(extent.address)
        return known[1] if known is not None and known[0] == extent.nbytes else None

    def _destinations(self, sizes: list[int]) -> list[torch.Tensor]:
        """Fresh uint8 buffers of ``sizes`` on the device, carved from one allocation."""
        offsets, total = aligned_offsets(sizes)
        if self._device.type == "cpu":
            arena = HugePageArena(chunk_bytes=total)
            return [arena.empty(size, torch.uint8) for size in sizes]
        whole = torch.empty(total, dtype=torch.uint8, device=self._device)
        return [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]

    def _onednn_weights(self) -> list[tuple[PrepackedLinear, torch.Tensor]]:
        return [
            (module, module.packed_weight)
            for root in self._roots
            if isinstance(root, nn.Module)
            for module in root.modules()
            if isinstance(module, PrepackedLinear) and module.packed_weight.is_mkldnn
        ]


def _raw(packed: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN tensor's bytes as a uint8 tensor (alive while ``packed`` is)."""
    return raw_bytes(torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed))
