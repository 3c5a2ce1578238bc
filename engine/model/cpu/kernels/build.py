"""Building and loading the C kernels: compiled on first use with the system compiler, loaded by
ctypes, their entry points typed once.

Each instruction-set variant (`ISAS`, chosen by $MODELYARD_CPU_ISA, see `compile_flags`) is built
once per process (lazily, thread-safe) into <MODELYARD_CACHE_DIR>/cpu_kernels/, named by the
variant and a hash of the sources, flags, compiler version and CPU (the flags name the build
machine's CPU: -march=native, -mtune=native), written to a temp file and renamed so concurrent
processes never load half a file. Each load marks its build as used (mtime); a new build removes
the ones unused for two weeks (`cache_dir.remove_stale`: earlier sources, or gone CPUs that
shared the folder). It links `-fopenmp` against libgomp.so.1; torch is imported first, so the
dynamic loader reuses torch's already-mapped libgomp and the kernel's OpenMP team comes from
torch's thread pool.

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
import threading
from pathlib import Path

import torch

from common.cache_dir import cache_root
from engine.model.cache_dir import remove_stale, replaced_atomically

log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "isa.c",
        "paged_decode.c",
        "fused_ops.c",
        "panel_gemm.c",
        "quant_gemm.c",
        "narrow_decode.c",
    )
)
_HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "bf16.h",
        "fast_exp.h",
        "paged_decode.h",
        "panel_gemm.h",
        "quant_gemm.h",
        "row_ops.h",
        "spin_barrier.h",
    )
)
# -ffp-contract=fast (gcc's default in GNU C mode, not clang's) fuses the D-loop multiply-adds
# into FMAs; no -ffast-math, so NaN and inf stay IEEE. -lm goes after the source.
_FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
_LIBS = ("-lm",)
# The kernels' instruction sets, as $MODELYARD_CPU_ISA names them: auto (what the CPU has: avx512,
# avx2 or generic), avx512, avx2 (AVX2 + FMA, e.g. to measure an AVX2-only CPU's speed on an
# AVX-512 one), generic (plain C, compiler-vectorised for baseline x86-64).
ISA_ENV = "MODELYARD_CPU_ISA"
ISAS = ("auto", "avx512", "avx2", "generic")
# The CPU features (/proc/cpuinfo flags) a forced variant needs.
_NEEDS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma")}
_X86 = ("x86_64", "amd64", "i386", "i686")
# -march=haswell is the baseline AVX2 + FMA CPU: no AVX-512 or AMX subset can slip in, whatever
# the build machine has, and every gcc and clang knows it (-mno-* lists differ between versions).
_ARCH_FLAGS = {
    "native": ("-march=native", "-mprefer-vector-width=512"),
    "avx2": ("-march=haswell", "-mtune=native"),
    "generic": ("-march=x86-64", "-mtune=native"),
}
_BUILD_TIMEOUT_S = 120
# The element types of the typed entry points (name_f32, name_bf16).
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_STDERR_TAIL = 2000

_lock = threading.Lock()
_variants: dict[str | None, str] = {}  # an asked ISA (None: $MODELYARD_CPU_ISA) -> its build
_libs: dict[str, ctypes.CDLL | None] = {}  # a build -> the loaded CDLL, None once it failed
# Every library file opened, never forgotten (a dlopen'd library stays mapped anyway): a reset()
# then hands out the same CDLL object, whose entry points other modules may have typed.
_opened: dict[Path, ctypes.CDLL] = {}


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library of instruction set ``isa`` (one of `ISAS`; None: as
    $MODELYARD_CPU_ISA says), building it on first call; None when it cannot be built."""
    variant = _variants.get(isa)
    if variant is None or variant not in _libs:
        with _lock:
            variant = _variants.get(isa)
            if variant is None:
                variant = _variants[isa] = _variant(isa)
            if variant not in _libs:
                _libs[variant] = _build_and_load(variant)
    return _libs[variant]


def available() -> bool:
    return load() is not None


def isa() -> str | None:
    """The instruction set the default build's kernels run ("avx512", "avx2" or "generic"), or
    None without a build."""
    lib = load()
    return None if lib is None else lib.kernels_isa().decode()


def reset() -> None:
    """Forget the chosen ISA and which builds exist, so the next `load()` looks again (tests)."""
    with _lock:
        _variants.clear()
        _libs.clear()


def compile_flags(variant: str, machine: str) -> tuple[str, ...]:
    """The compiler flags of a build variant ("native", "avx2", "generic") on a machine
    (platform.machine()); off x86 no arch flags, as -march values are x86's."""
    arch = _ARCH_FLAGS[variant] if machine.lower() in _X86 else ()
    return (*_FLAGS[:1], *arch, *_FLAGS[1:])


def resolve_isa(asked: str, machine: str, cpu_flags: set[str]) -> str:
    """The build variant that serves ISA ``asked`` on this machine: "native" (-march=native, what
    auto and avx512 build), "avx2" or "generic". A variant the CPU cannot run, or any forced one
    off x86, warns and builds native instead."""
    if asked not in ISAS:
        log.warning("%s=%r is none of %s: using auto", ISA_ENV, asked, ", ".join(ISAS))
        return "native"
    if asked == "auto":
        return "native"
    if machine.lower() not in _X86:
        if asked != "generic":  # the plain C paths are all there is off x86
            log.warning("%s=%s needs an x86 CPU, not %s: using auto", ISA_ENV, asked, machine)
        return "native"
    missing = [flag for flag in _NEEDS.get(asked, ()) if flag not in cpu_flags]
    if missing:
        log.warning("%s=%s: this CPU lacks %s: using auto", ISA_ENV, asked, ", ".join(missing))
        return "native"
    return "native" if asked == "avx512" else asked


def _variant(isa: str | None) -> str:
    if isa is None:
        asked = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    elif isa in ISAS:
        asked = isa
    else:
        raise ValueError(f"unknown kernel ISA {isa!r}: one of {', '.join(ISAS)}")
    return resolve_isa(asked, platform.machine(), _cpu_flags())


def _build_and_load(variant: str) -> ctypes.CDLL | None:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    try:
        path = _build(compiler, variant)
        lib = _opened.get(path) or ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        log.warning(
            "CPU kernels unavailable (%s build; attention and the elementwise ops run in torch): "
            "%s failed: %s",
            variant,
            " ".join(compiler),
            (detail or "").strip()[-_STDERR_TAIL:],
        )
        return None
    if path not in _opened:
        _bind(lib)
        _opened[path] = lib
    log.info("CPU kernels: %s build (%s)", lib.kernels_isa().decode(), path.name)
    return lib


def _bind(lib: ctypes.CDLL) -> None:
    """Type the entry points of this module's sources."""
    lib.kernels_isa.argtypes = []
    lib.kernels_isa.restype = ctypes.c_char_p
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_float, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    fused = lib.decode_qkv_attention
    fused.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64]
    fused.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    fused.restype = ctypes.c_int
    narrow = lib.decode_narrow_layers  # its structs: narrow_decode.py
    narrow.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int, ptr]
    narrow.restype = ctypes.c_int
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


def _build(compiler: list[str], variant: str = "native") -> Path:
    """Compile build ``variant`` into the cache (unless already there) and return its path."""
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    flags = compile_flags(variant, platform.machine())
    digest = hashlib.sha256()
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    for part in (*sources, " ".join((*flags, *_LIBS)).encode(), version.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_signature().encode())
    folder = cache_root() / "cpu_kernels"
    target = folder / f"cpu_kernels-{variant}-{digest.hexdigest()[:24]}.so"
    if target.exists():
        os.utime(target)  # in use: not stale
        return target
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(folder, "cpu_kernels-*.so")
    with replaced_atomically(target, ".so") as temp:
        subprocess.run(
            [*compiler, *flags, "-o", str(temp), *map(str, _SOURCES), *_LIBS],
            capture_output=True,
            text=True,
            check=True,
            timeout=_BUILD_TIMEOUT_S,
        )
    return target


def _cpu_info() -> list[str]:
    """The first processor's model and feature lines of /proc/cpuinfo (empty where unreadable)."""
    lines: list[str] = []
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                    lines.append(line)
                if not line.strip() and lines:  # first processor's block is enough
                    break
    except OSError:
        pass
    return lines


def _cpu_flags() -> set[str]:
    """The CPU's feature names (x86 "flags", Arm "Features")."""
    return {word for line in _cpu_info() for word in line.split(":", 1)[1].split()}


def _cpu_signature() -> str:
    """Machine and CPU model + feature flags: a build tuned for this CPU must not be reused by a
    different CPU sharing the cache directory."""
    return platform.machine() + ("".join(_cpu_info()) or platform.processor())
