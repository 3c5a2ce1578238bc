"""Building and loading the C kernels: compiled on first use with the system compiler, loaded by
ctypes, their entry points typed once.

The shared library is built once per process (lazily, thread-safe) into
<MODELYARD_CACHE_DIR>/cpu_kernels/, named by a hash of the sources, flags, compiler version and CPU
(it is built with -march=native), written to a temp file and renamed so concurrent processes never
load half a file. Each load marks its build as used (mtime); a new build removes the ones unused for
`_STALE_AFTER_S` (earlier sources, or gone CPUs that shared the folder). It links `-fopenmp`
against libgomp.so.1; torch is imported first, so the dynamic loader reuses torch's already-mapped
libgomp and the kernel's OpenMP team comes from torch's thread pool.

No compiler or a failed build logs one warning and `load()` returns None: callers use torch instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("paged_decode.c", "fused_ops.c", "panel_gemm.c")
)
_HEADERS = tuple(
    Path(__file__).with_name(name) for name in ("bf16.h", "fast_exp.h", "panel_gemm.h")
)
# -ffp-contract=fast (gcc's default in GNU C mode, not clang's) fuses the D-loop multiply-adds
# into FMAs; no -ffast-math, so NaN and inf stay IEEE. -lm goes after the source.
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=fast", "-fopenmp")
_FLAGS += ("-shared", "-fPIC")
_LIBS = ("-lm",)
_BUILD_TIMEOUT_S = 120
_STALE_AFTER_S = 14 * 24 * 3600
# The element types of the typed entry points (name_f32, name_bf16).
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_STDERR_TAIL = 2000

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None once a load was attempted


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first call; None when it cannot be built."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _build_and_load()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return load() is not None


def reset() -> None:
    """Forget the loaded library so the next `load()` builds again (tests)."""
    with _lock:
        _state.clear()


def _build_and_load() -> ctypes.CDLL | None:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        log.warning(
            "CPU decode kernel unavailable (attention falls back to torch): %s failed: %s",
            " ".join(compiler),
            (detail or "").strip()[-_STDERR_TAIL:],
        )
        return None
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_float, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    fused = lib.decode_qkv_attention
    fused.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64]
    fused.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    fused.restype = ctypes.c_int
    for suffix in DTYPE_SUFFIXES.values():
        norm, rope = getattr(lib, "add_rms_norm_" + suffix), getattr(lib, "rope_" + suffix)
        norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
        norm.restype = None
        rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int]
        rope.restype = None
        silu_mul = getattr(lib, "silu_mul_" + suffix)
        silu_mul.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        silu_mul.restype = None
        argmax = getattr(lib, "argmax_rows_" + suffix)
        argmax.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        argmax.restype = None
    lib.scatter_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64]
    lib.scatter_rows.restype = None
    lib.read_paged_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.read_paged_kv.restype = ctypes.c_uint64
    lib.panel_gemm_available.argtypes = []
    lib.panel_gemm_available.restype = ctypes.c_int
    lib.panel_gemm_packed_size.argtypes = [i64, i64, i64]
    lib.panel_gemm_packed_size.restype = i64
    lib.panel_gemm_pack.argtypes = [ptr, i64, i64, i64, ptr]
    lib.panel_gemm_pack.restype = None
    lib.panel_gemm.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, ptr, ctypes.c_int]
    lib.panel_gemm.restype = None
    return lib


def _build(compiler: list[str]) -> Path:
    """Compile into the cache (unless already there) and return the library's path."""
    from engine.model.loader import cache_root  # deferred: the loader imports transformers

    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    digest = hashlib.sha256()
    flags = " ".join((*_FLAGS, *_LIBS))
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    for part in (*sources, flags.encode(), version.encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    folder = cache_root() / "cpu_kernels"
    target = folder / f"cpu_kernels-{digest.hexdigest()[:24]}.so"
    if target.exists():
        os.utime(target)  # in use: not stale
        return target
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(folder)
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".cpu_kernels-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [*compiler, *_FLAGS, "-o", temp, *map(str, _SOURCES), *_LIBS],
            capture_output=True,
            text=True,
            check=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return target


def _remove_stale_builds(folder: Path) -> None:
    """Delete builds not loaded for _STALE_AFTER_S (a process that still maps one keeps it: the
    file is only unlinked)."""
    cutoff = time.time() - _STALE_AFTER_S
    for old in folder.glob("cpu_kernels-*.so"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # removed by a concurrent process, or not ours to remove
            pass


def _cpu_signature() -> str:
    """Machine and CPU model + feature flags: a -march=native build must not be reused by a
    different CPU sharing the cache directory."""
    lines = []
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                    lines.append(line)
                if not line.strip() and lines:  # first processor's block is enough
                    break
    except OSError:
        lines.append(platform.processor())
    return platform.machine() + "".join(lines)
