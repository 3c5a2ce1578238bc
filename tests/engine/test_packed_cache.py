"""The packed cache (engine/model/cpu/packed_cache.py): a load's packed weights written once and
mapped by every later load, byte for byte what packing gives; a stale or broken file packed
again and rewritten; a park that drops the mapped pages without writing them anywhere; and two
processes mapping one file sharing its pages. Whole loads: tests/engine/test_narrow_weights.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from common.processes import mapping_bytes
from engine.model.cpu import packed_cache
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.packed_cache import PackedSlots, open_mapped
from engine.model.cpu.quant_formats import QuantizedWeight, quantize
from engine.model.cpu.quant_linear import QuantizedLinear
from engine.model.park.weights import WeightParker

pytestmark = pytest.mark.skipif(quant_gemm.library() is None, reason="no C compiler here")
CPU = torch.device("cpu")
SHAPES = [(256, 128, "int8"), (1024, 256, "int4"), (512, 512, "int8")]  # 520 KiB packed


def _weights(shapes=SHAPES) -> list[QuantizedWeight]:
    generator = torch.Generator().manual_seed(0)
    return [quantize(torch.randn(n, k, generator=generator), fmt) for n, k, fmt in shapes]


def _load(path: Path, weights: list[QuantizedWeight]) -> tuple[nn.ModuleList, PackedSlots]:
    lib = quant_gemm.library()
    slots = PackedSlots(lib, path)
    model = nn.ModuleList(QuantizedLinear(w, None, lib, slots=slots) for w in weights)
    return model, slots


def test_a_later_load_maps_the_bytes_the_first_packed(tmp_path, monkeypatch):
    path = tmp_path / "packed" / "w.bin"
    weights = _weights()
    expected = [quant_gemm.pack(quant_gemm.library(), w) for w in weights]
    first, slots = _load(path, weights)
    mapped = slots.finish()
    assert mapped is not None and path.is_file()
    for module, packed in zip(first, expected, strict=True):  # the first load's now views too
        assert mapped.holds(module.packed.data_ptr()) and torch.equal(module.packed, packed)

    def no_packing(*_):
        raise AssertionError("packed again")

    monkeypatch.setattr(quant_gemm, "pack", no_packing)
    second, slots = _load(path, weights)
    mapped = slots.finish()
    assert mapped is not None and slots.path == path
    x = torch.randn(3, 128)
    for module, packed in zip(second, expected, strict=True):
        assert mapped.holds(module.packed.data_ptr()) and module.packed.data_ptr() % 4096 == 0
        assert torch.equal(module.packed, packed)
    assert torch.equal(second[0](x), first[0](x))


def test_a_file_that_does_not_match_the_load_is_packed_again_and_rewritten(tmp_path):
    path = tmp_path / "w.bin"
    _, slots = _load(path, _weights())
    slots.finish()
    changed = [(256, 128, "int8"), (1024, 256, "int8"), (512, 512, "int8")]  # the 2nd's format
    model, slots = _load(path, _weights(changed))  # from the 2nd on, into a new file
    assert [slots.mapped.holds(m.packed.data_ptr()) for m in model] == [True, False, False]
    mapped = slots.finish()
    assert mapped is not None and all(mapped.holds(m.packed.data_ptr()) for m in model)
    assert [e[0] for e in open_mapped(path).entries] == ["int8"] * 3
    _, slots = _load(path, _weights(changed[:2]))  # an entry too many: written again
    assert slots.finish() is not None and len(open_mapped(path).entries) == 2


@pytest.mark.parametrize("damage", ["cut", "magic", "offset"])
def test_a_broken_file_is_ignored(tmp_path, damage):
    path = tmp_path / "w.bin"
    _, slots = _load(path, _weights())
    slots.finish()
    data = bytearray(path.read_bytes())
    if damage == "cut":
        data = data[: len(data) - 8192]
    elif damage == "magic":
        data[0] ^= 0xFF
    else:
        data = data.replace(b'"int8", 256, 128, 4096', b'"int8", 256, 128, 4097')
    path.write_bytes(bytes(data))
    assert open_mapped(path) is None
    _, slots = _load(path, _weights())
    assert slots.mapped is None and slots.finish() is not None  # packed, and written whole
    assert open_mapped(path) is not None


def test_a_park_drops_the_mapped_pages_and_writes_nothing(tmp_path):
    model, slots = _load(tmp_path / "w.bin", _weights())
    mapped = slots.finish()
    x = torch.randn(2, 512)
    before = [module(x[:, : module.in_features]) for module in model]
    assert mapping_bytes(mapped.address, "Rss") > 0
    parker = WeightParker([model], CPU, tmp_path / "park", mapped)
    moved = parker.park()
    assert moved.copied == 0  # nothing written: the file is their home
    packed = sum(module.packed.numel() for module in model)
    assert packed <= moved.resident_before <= mapped.nbytes  # extents span the page padding
    assert mapping_bytes(mapped.address, "Rss") == 0
    assert parker.wake().copied == 0
    assert mapping_bytes(mapped.address, "Rss") >= packed  # mapped again before any step
    after = [module(x[:, : module.in_features]) for module in model]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(mapped.holds(module.packed.data_ptr()) for module in model)


CHILD = """
import sys
from pathlib import Path
from engine.model.cpu.packed_cache import open_mapped
from common.processes import mapping_bytes
mapped = open_mapped(Path(sys.argv[1]))
total = sum(int(mapped.view(i).sum()) for i in range(len(mapped.entries)))  # every page read
rss, pss = (mapping_bytes(mapped.address, field) for field in ("Rss", "Pss"))
print(rss, pss, total)
sys.stdout.flush()
sys.stdin.read()  # holds its mapping until the parent has measured
"""


def test_two_processes_mapping_one_file_share_its_pages(tmp_path):
    path = tmp_path / "w.bin"
    _, slots = _load(path, _weights())
    mapped = slots.finish()
    total = sum(int(mapped.view(i).sum()) for i in range(len(mapped.entries)))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        rss, pss, child_total = map(int, child.stdout.readline().split())
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child_total == total and rss >= mapped.nbytes - 4096  # all but the header
    assert pss <= rss * 0.6  # two processes map the same page-cache pages: half each


@pytest.mark.parametrize("fails_at", [0, 2])
def test_where_the_file_cannot_be_written_the_modules_keep_their_own(
    tmp_path, monkeypatch, fails_at
):
    """A full disk when the first or a later weight's pages are reserved: no file is left, and
    every module holds its packed bytes in a buffer of its own."""
    reserve = packed_cache.os.posix_fallocate
    calls = []

    def disk_full(fd, offset, size):
        calls.append(offset)
        if len(calls) > fails_at:
            raise OSError(28, "No space left on device")
        reserve(fd, offset, size)

    monkeypatch.setattr(packed_cache.os, "posix_fallocate", disk_full)
    weights = _weights()
    model, slots = _load(tmp_path / "w.bin", weights)
    assert slots.finish() is None and list(tmp_path.iterdir()) == []
    lib = quant_gemm.library()
    for module, weight in zip(model, weights, strict=True):
        assert torch.equal(module.packed, quant_gemm.pack(lib, weight))
        assert module.packed.untyped_storage().nbytes() == module.packed.numel()  # its own


def test_a_load_that_fails_leaves_no_file_behind(tmp_path):
    _, slots = _load(tmp_path / "w.bin", _weights())
    assert len(list(tmp_path.iterdir())) == 1  # being written, under a temporary name
    slots.abandon()
    assert list(tmp_path.iterdir()) == []


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, file) of this process's mapping that holds ``address`` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[1], fields[5] if len(fields) > 5 else ""
    raise AssertionError("no such mapping")


def test_each_weight_is_packed_into_the_new_files_pages(tmp_path):
    """No buffer of the load's own then a copy: while the load goes on, each module's bytes are
    pages of the file being written (a shared mapping); finishing maps the complete file."""
    model, slots = _load(tmp_path / "w.bin", _weights())
    (temp,) = tmp_path.iterdir()
    for module in model:
        assert _mapping_of(module.packed.data_ptr()) == ("rw-s", str(temp))
    mapped = slots.finish()
    assert mapped is not None and all(mapped.holds(m.packed.data_ptr()) for m in model)
    assert [p.name for p in tmp_path.iterdir()] == ["w.bin"]
