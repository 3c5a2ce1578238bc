"""A GGUF file's header, read without its arrays: the scalar metadata (architecture, layer count,
file type ...) and the tensor table. gguf.GGUFReader parses every array too, which for a 262k-token
vocabulary takes 20 s on a loaded 2-core VM; skipping them takes a fraction of a second."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

MAGIC = b"GGUF"
_T = gguf.GGUFValueType
_SCALARS = {
    _T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I",
    _T.INT32: "<i", _T.FLOAT32: "<f", _T.BOOL: "<?", _T.UINT64: "<Q", _T.INT64: "<q",
    _T.FLOAT64: "<d",
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str  # "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # GGUF order: inputs first
    n_bytes: int  # as stored in the file

    @property
    def n_elements(self) -> int:
        return _elements(self.shape)


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class Header:
    metadata: dict[str, object] = field(default_factory=dict)  # arrays: their length only
    tensors: list[TensorInfo] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def string(self) -> str:
        n = self.u64()
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", "replace")

    def value(self, vtype: int) -> object:
        if vtype == _T.STRING:
            return self.string()
        if vtype == _T.ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[_T(etype)])
            else:  # strings (a vocabulary) or nested arrays: one length prefix each
                for _ in range(count):
                    self.value(etype)
            return count
        return self.unpack(_SCALARS[_T(vtype)])


def _tensor_bytes(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return _elements(shape) // block * type_size


def read_header(path: Path) -> Header:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.u32()
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (little-endian 2 or 3 expected)")
        n_tensors, n_kv = cur.u64(), cur.u64()
        header = Header()
        for _ in range(n_kv):
            key = cur.string()
            header.metadata[key] = cur.value(cur.u32())
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.u64() for _ in range(cur.u32()))
            qtype = gguf.GGMLQuantizationType(cur.u32())
            cur.u64()  # the data offset
            header.tensors.append(TensorInfo(name, qtype.name, shape, _tensor_bytes(qtype, shape)))
    return header
