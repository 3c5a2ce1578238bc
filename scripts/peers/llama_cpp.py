"""Build llama.cpp's llama-server (and llama-quantize) from a pinned, hash-checked source.

The source is the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python, fetched with
pip (PyPI is the one registry we may reach) and checked against SHA256 below. The build is cached
under .cache/peers/llama.cpp-<version>-<isa>/, so a second run finds the binaries in seconds.

    python -m scripts.peers.llama_cpp            # build (or find) the binaries, print their paths
    MODELYARD_CPU_ISA=avx2 python -m scripts.peers.llama_cpp   # AVX2-only build, for parity
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = REPO_ROOT / ".cache" / "peers"
PACKAGE = "llama_cpp_python"
VERSION = "0.3.36"
SDIST = f"{PACKAGE}-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TARGETS = ("llama-server", "llama-quantize")

# Everything but the CPU backend and the two tools is off: no network (curl, OpenSSL, the web
# UI's download from a Hugging Face bucket), no tests or examples, one static binary per tool.
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DGGML_BACKEND_DL=OFF",
)

# Option names from the vendored ggml/CMakeLists.txt. "avx2" matches Modelyard's forced AVX2
# build (MODELYARD_CPU_ISA=avx2): every wider or newer extension is turned off explicitly.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_SSE42=ON",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ),
}


# $MODELYARD_CPU_ISA (engine/model/cpu/kernels/build.py) -> the llama.cpp build that matches:
# Modelyard's auto and avx512 variants compile with -march=native, so llama.cpp does too.
ISA_ENV = "MODELYARD_CPU_ISA"
_FROM_MODELYARD = {"": "native", "auto": "native", "avx512": "native", "avx2": "avx2"}


def isa_from_env(env: dict[str, str] | None = None) -> str:
    """The ISA to build for: "avx2" when Modelyard's AVX2 build is forced, else "native"."""
    value = (os.environ if env is None else env).get(ISA_ENV, "").strip().lower()
    if value not in _FROM_MODELYARD:
        raise ValueError(
            f"{ISA_ENV}={value!r}: llama.cpp builds only for {sorted(_FROM_MODELYARD)}"
        )
    return _FROM_MODELYARD[value]


def cmake_flags(isa: str) -> list[str]:
    return [*COMMON_FLAGS, *ISA_FLAGS[isa]]


@dataclass(frozen=True)
class Build:
    root: Path  # .cache/peers/llama.cpp-<version>-<isa>
    isa: str

    @property
    def bin_dir(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    def ready(self) -> bool:
        return all(os.access(self.bin_dir / t, os.X_OK) for t in TARGETS)


def build_dir(isa: str, cache: Path = CACHE) -> Build:
    return Build(cache / f"llama.cpp-{VERSION}-{isa}", isa)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(cache: Path = CACHE) -> Path:
    """The pinned sdist, downloaded by pip into the cache once and hash-checked every time."""
    dest = cache / "downloads"
    path = dest / SDIST
    if not path.exists():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, f"{PACKAGE}=={VERSION}", "-d", str(dest)], check=True)
    digest = sha256(path)
    if digest != SHA256:
        path.unlink()  # a bad download must not poison the cache
        raise RuntimeError(f"{SDIST}: sha256 {digest}, expected {SHA256}")
    return path


def extract_vendor(sdist: Path, dest: Path) -> Path:
    """Unpack only vendor/llama.cpp from the sdist into dest/src."""
    src = dest / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    prefix = f"{PACKAGE}-{VERSION}/vendor/llama.cpp/"
    tmp = dest / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix) :]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(src)
    return src


def build(isa: str | None = None, jobs: int = 2, cache: Path = CACHE) -> Build:
    """Configure and build the two targets (output in Build.log); a no-op when cached."""
    b = build_dir(isa or isa_from_env(), cache)
    if b.ready():
        return b
    b.root.mkdir(parents=True, exist_ok=True)
    src = extract_vendor(fetch_sdist(cache), b.root)
    with b.log.open("a") as log:
        cfg = ["cmake", "-S", str(src), "-B", str(b.root / "build"), *cmake_flags(b.isa)]
        if shutil.which("ninja"):
            cfg += ["-G", "Ninja"]
        subprocess.run(cfg, check=True, stdout=log, stderr=subprocess.STDOUT)
        bld = ["cmake", "--build", str(b.root / "build"), "-j", str(jobs), "--target", *TARGETS]
        subprocess.run(bld, check=True, stdout=log, stderr=subprocess.STDOUT)
    if not b.ready():
        raise RuntimeError(f"build finished without {TARGETS}; see {b.log}")
    return b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=sorted(ISA_FLAGS), help="default: from MODELYARD_CPU_ISA")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs")
    args = p.parse_args(argv)
    b = build(args.isa, args.jobs)
    print(b.server)
    print(b.quantize)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
