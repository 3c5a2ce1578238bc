"""A GGUF file's header as the benchmarks read it: the scalar metadata (architecture, layer
count, file type ...) and the tensor table with each tensor's bytes in the file. The engine's own
reader (engine.model.cpu.gguf_file) parses it without gguf.GGUFReader's arrays, which for a
262k-token vocabulary take 20 s on a loaded 2-core VM."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.model.cpu.gguf_file import GgufFile


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str  # "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # GGUF order: inputs first
    n_bytes: int  # as stored in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Header:
    metadata: dict[str, object] = field(default_factory=dict)  # scalars and strings
    tensors: list[TensorInfo] = field(default_factory=list)


def read_header(path: Path) -> Header:
    file = GgufFile(path)
    tensors = [
        TensorInfo(t.name, t.tensor_type.name, t.shape, t.data.nbytes)
        for t in file.tensors.values()
    ]
    return Header(dict(file.fields), tensors)
