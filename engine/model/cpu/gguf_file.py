"""A GGUF file's tensors and metadata, read from its header and mapped, without gguf's reader.

gguf's GGUFReader turns every metadata value into numpy views first: for Gemma 3's 262,144-token
vocabulary that is ~790,000 small arrays, 8 s of a start and ~600 MiB of Python objects that
outlive it. This reads the scalars and strings, numeric arrays as views of the mapping, and
arrays of strings only when asked (the vocabulary's strings, for its one-time conversion; the
weights skip them by their lengths); it maps the file once and tensor data are views into that
mapping (the page cache holds them, shared with other readers).
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# Metadata value types: 8 is a string, 9 an array, the others scalars (_SCALAR_FORMATS).
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
_CUT = "the GGUF file ends inside its header"
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_DENSE_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


@dataclass
class GgufArray:
    """A metadata array: its items' type, its length and its values (numbers: a view of the
    mapping; strings: their text if the file was read with ``read_strings``; else None)."""

    item_type: int
    count: int
    values: np.ndarray | list[str] | None


@dataclass
class GgufTensor:
    """One tensor: ``shape`` in GGUF's order (innermost first: [K, N] for an N x K weight);
    ``data`` as gguf's reader gives it (dense: [N, K] values; blocks: [N, bytes a row] uint8)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GgufFile:
    """The tensors of the GGUF file at ``path`` (by name) and its metadata: ``fields`` the
    scalars and strings, ``arrays`` the arrays, ``types`` every key's GGUF type in file order
    ([type] or, for an array, [9, item type])."""

    def __init__(self, path: Path, read_strings: bool = False) -> None:
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        self._at = 0
        if bytes(self._take(4)) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        self.arrays: dict[str, GgufArray] = {}
        self.types: dict[str, list[int]] = {}
        for _ in range(field_count):
            key, kind = self._string(), int(self._unpack("<I"))
            if kind == _ARRAY:
                self.arrays[key] = self._array(read_strings)
                self.types[key] = [kind, self.arrays[key].item_type]
            else:
                self.fields[key] = self._value(kind)
                self.types[key] = [kind]
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        self.tensors = {
            name: GgufTensor(name, kind, shape, self._data(start + offset, kind, shape))
            for name, kind, shape, offset in infos
        }

    @property
    def architecture(self) -> str:
        return str(self.fields["general.architecture"])

    def _take(self, size: int) -> memoryview:
        piece = self._buffer[self._at : self._at + size]
        if len(piece) != size:
            raise ValueError(_CUT)
        self._at += size
        return piece

    def _unpack(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self._buffer, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return bytes(self._take(int(self._unpack("<Q")))).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> object:
        """The scalar or string of type ``kind`` at the cursor."""
        if kind in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self._string()
        raise ValueError(f"unknown GGUF metadata type {kind}")

    def _array(self, read_strings: bool) -> GgufArray:
        item, count = int(self._unpack("<I")), int(self._unpack("<Q"))
        values: np.ndarray | list[str] | None = None
        if item in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[item])
            values = np.frombuffer(self._take(count * dtype.itemsize), dtype)
        elif item == _STRING and read_strings:
            values = self._strings(count)
        elif item == _STRING:
            self._skip_strings(count)
        elif item == _ARRAY:  # nested arrays (no known key has them): skipped
            for _ in range(count):
                self._array(read_strings=False)
        else:
            raise ValueError(f"unknown GGUF metadata type {item}")
        return GgufArray(item, count, values)

    def _strings(self, count: int) -> list[str]:
        """``count`` strings, decoded strictly: a token that is not UTF-8 is an error, as it is
        to transformers."""
        at, end, length, buffer = self._at, len(self._buffer), _LENGTH.unpack_from, self._buffer
        strings = []
        for _ in range(count):
            if at + 8 > end:
                raise ValueError(_CUT)
            start, at = at + 8, at + 8 + length(buffer, at)[0]
            if at > end:
                raise ValueError(_CUT)
            strings.append(str(buffer[start:at], "utf-8"))
        self._at = at
        return strings

    def _skip_strings(self, count: int) -> None:
        """Past ``count`` strings, reading only their lengths: a vocabulary of hundreds of
        thousands of strings nobody reads is not decoded."""
        at, end, length = self._at, len(self._buffer), _LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise ValueError(_CUT)
            at += 8 + length(self._buffer, at)[0]
        if at > end:
            raise ValueError(_CUT)
        self._at = at

    def _tensor_info(self) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = self._string()
        dims = int(self._unpack("<I"))
        shape = tuple(int(self._unpack("<Q")) for _ in range(dims))
        kind = GGMLQuantizationType(int(self._unpack("<I")))
        return name, kind, shape, int(self._unpack("<Q"))

    def _data(self, offset: int, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
        rows = int(np.prod(shape[1:], dtype=np.int64))
        outer = tuple(reversed(shape[1:]))
        if kind in _DENSE_DTYPES:
            dtype = np.dtype(_DENSE_DTYPES[kind])
            size = rows * shape[0] * dtype.itemsize
            values = self._map[offset : offset + size].view(dtype)
            return values.reshape(*outer, shape[0]) if outer else values
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * block_bytes
        return self._map[offset : offset + rows * row_bytes].reshape(*outer, row_bytes)
