"""A file's sha256, read in chunks: model files run to gigabytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 * 2**20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
