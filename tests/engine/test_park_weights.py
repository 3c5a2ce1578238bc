"""WeightParker in-process: a park moves every tensor a module graph holds into the park file and a
wake back into fresh memory, keeping values, views, shared storages and alignment; the old memory
is released; a second park writes nothing; oneDNN's opaque prepacked weights come back exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.cpu.linear import prepack_linears, prepack_supported
from engine.model.host_memory import trim_heap
from engine.model.park.weights import WeightParker

CPU = torch.device("cpu")
BIG = 8 * 2**20  # fp32 elements: 32 MiB, so that the process's RSS shows it leave


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class Holder(nn.Module):
    """Weights held every way the walk must follow: parameter, buffer views, plain attributes,
    lists and dicts, two tensors apart in one storage, an empty one, a big one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32), requires_grad=False)
        self.register_buffer("rows", self.weight[8:24])  # a view of the parameter
        self.transposed = self.weight.t()
        flat = torch.randn(4096)
        self.register_buffer("head", flat[:1000])
        self.tail = [flat[3000:], {"inner": flat[3000:3100]}]  # overlapping, apart from head
        self.empty = torch.empty(0, 5)
        self.big = torch.full((BIG + 16,), 3.0)[16:]  # its base is held by the view alone

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "weight": self.weight,
            "rows": self.rows,
            "transposed": self.transposed,
            "head": self.head,
            "tail": self.tail[0],
            "inner": self.tail[1]["inner"],
            "big": self.big,
        }

    def layout(self) -> dict[str, int]:
        """Where each tensor sits relative to the one it shares memory with."""
        base, flat = self.weight.data_ptr(), self.head.data_ptr()
        return {
            "rows": self.rows.data_ptr() - base,
            "transposed": self.transposed.data_ptr() - base,
            "inner": self.tail[1]["inner"].data_ptr() - self.tail[0].data_ptr(),
            "alignment": base % 64,
            "shared": int(
                self.head.untyped_storage().data_ptr() == self.tail[0].untyped_storage().data_ptr()
            ),
            "head": flat % 64,
        }


def _check_same(holder: Holder, values: dict[str, torch.Tensor], layout: dict[str, int]) -> None:
    for name, tensor in holder.tensors().items():
        assert torch.equal(tensor, values[name]), name
        assert tensor.stride() == values[name].stride(), name
    assert holder.layout() == layout
    assert holder.empty.shape == (0, 5)


def test_park_and_wake_keep_values_views_and_shared_storages(tmp_path):
    holder = Holder()
    values = {name: t.clone() for name, t in holder.tensors().items()}
    layout = holder.layout()
    parker = WeightParker([holder], CPU, tmp_path / "park")
    assert parker.resident_bytes() >= BIG * 4
    before = _rss()

    moved = parker.park()
    trim_heap()  # as the runner does: freed memory may sit in glibc's heap (after other tests)
    assert moved.resident_after == 0 and moved.copied >= BIG * 4
    assert parker.resident_bytes() == 0
    assert before - _rss() >= BIG * 4 * 3 // 4, "the big tensor's memory was not released"
    assert list((tmp_path / "park").iterdir()) == [], "the park file is unlinked at once"
    _check_same(holder, values, layout)  # parked tensors read from the file

    parker.wake()
    assert parker.resident_bytes() == moved.resident_before
    _check_same(holder, values, layout)
    assert parker.park().copied == 0, "a second park writes nothing"
    parker.wake()
    _check_same(holder, values, layout)

    holder.weight[10, 3] = 7.0  # still views of one memory after the round trips
    assert holder.rows[2, 3] == 7.0 and holder.transposed[3, 10] == 7.0
    holder.tail[0][50] = 5.0
    assert holder.tail[1]["inner"][50] == 5.0


@pytest.mark.skipif(not prepack_supported(CPU, torch.float32), reason="no oneDNN prepacking")
def test_onednn_prepacked_weights_come_back_exact(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32)).eval()
    prepack_linears(model, batch_size_hint=4)
    assert model[0].packed_weight.is_mkldnn
    long_rows, short_rows = torch.randn(200, 64), torch.randn(3, 64)  # oneDNN; panels or plain
    with torch.no_grad():
        expected = model(long_rows), model(short_rows)
    parker = WeightParker([model], CPU, tmp_path)
    for _ in range(2):
        parker.park()
        assert parker.resident_bytes() == 0
        parker.wake()
        with torch.no_grad():
            assert torch.equal(model(long_rows), expected[0])
            assert torch.equal(model(short_rows), expected[1])
