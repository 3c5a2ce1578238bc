"""Linear layers on narrow weights in C (quant_gemm.c): `pack` lays a weight's column records
(engine.model.cpu.quant_formats) out in the kernel's groups of 8 interleaved columns once, `gemm`
runs ``x W^T + b`` on that, quantising the activations to int8 on the way in. The same
kernel serves every row count: prefill-sized inputs too (it beat dequantising into an fp32 GEMM
2x at 64-512 rows: docs/PERFORMANCE.md#narrow-weights)."""

from __future__ import annotations

import ctypes

import torch

from engine.model.cpu.kernels.build import load
from engine.model.cpu.quant_formats import QuantizedWeight

# The formats' codes in quant_gemm.c.
FORMAT_CODES = {
    "int8": 0,
    "int4": 1,
    "int8k": 2,
    "int5": 3,
    "int6": 4,
    "int4k": 5,
    "int8h": 6,
    "int5k": 7,
    "int5h": 8,
    "int2k": 9,
    "int8km": 10,
}

_typed: set[int] = set()  # libraries (by handle) whose entry points are typed


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel library (of ``isa``, see build.load) with this module's entry points typed."""
    lib = load(isa)
    if lib is not None and lib._handle not in _typed:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.quant_packed_bytes.argtypes = [ctypes.c_int, i64, i64]
        lib.quant_packed_bytes.restype = i64
        lib.quant_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
        lib.quant_pack.restype = None
        lib.quant_unpack_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
        lib.quant_unpack_rows.restype = i64
        lib.quant_gemm_isa.argtypes = []
        lib.quant_gemm_isa.restype = ctypes.c_char_p
        lib.quant_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
        lib.quant_gemm.restype = ctypes.c_int
        _typed.add(lib._handle)
    return lib


class NarrowLinear(ctypes.Structure):
    """quant_gemm.h's NarrowLinear: a packed weight [n, k] and its bias (pointers into tensors
    the owner keeps)."""

    _fields_ = [
        ("format", ctypes.c_int),
        ("packed", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


def narrow_linear(
    fmt: str, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None
) -> NarrowLinear:
    """The NarrowLinear of a `pack`ed weight [n, k] (valid while the tensors live)."""
    bias_ptr = None if bias is None else bias.data_ptr()
    return NarrowLinear(FORMAT_CODES[fmt], packed.data_ptr(), n, k, bias_ptr)


def isa(lib: ctypes.CDLL) -> str:
    """The integer dot product ``lib`` runs: vnni, avx2 or generic."""
    return lib.quant_gemm_isa().decode()


def packed_bytes(lib: ctypes.CDLL, weight: QuantizedWeight) -> int:
    """The size of ``weight`` in the kernel's layout."""
    return lib.quant_packed_bytes(FORMAT_CODES[weight.fmt], weight.out_features, weight.in_features)


def pack(
    lib: ctypes.CDLL, weight: QuantizedWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight`` in the kernel's layout (uint8, flat), into ``out`` (`packed_bytes` of them)
    when given."""
    code, n, k = FORMAT_CODES[weight.fmt], weight.out_features, weight.in_features
    nbytes = packed_bytes(lib, weight)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
        raise ValueError(f"packing needs {nbytes} contiguous bytes, not {out.numel()}")
    lib.quant_pack(code, weight.records.contiguous().data_ptr(), n, k, out.data_ptr())
    return out


def unpack_rows(
    lib: ctypes.CDLL, fmt: str, packed: torch.Tensor, n: int, k: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` of the [n, k] weight `pack` made ``packed`` from: [len(ids), k] fp32."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), k), dtype=torch.float32)
    bad = lib.quant_unpack_rows(
        FORMAT_CODES[fmt], packed.data_ptr(), n, k, ids.data_ptr(), ids.numel(), out.data_ptr()
    )
    if bad >= 0:
        raise IndexError(f"index {int(ids[bad])} is out of range for {n} rows")
    return out


def gemm(
    lib: ctypes.CDLL,
    fmt: str,
    rows: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    threads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows`` [M, K] (fp32, contiguous) times the [n, K] weight `pack` made ``packed`` from,
    plus ``bias`` [n] (fp32) when given: [M, n] fp32, into ``out`` when given."""
    m, k = rows.shape
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32)
    status = lib.quant_gemm(
        FORMAT_CODES[fmt],
        rows.data_ptr(),
        m,
        k,
        packed.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        threads,
    )
    if status:
        raise MemoryError(f"quant_gemm could not allocate its scratch for {m} x {k} activations")
    return out
