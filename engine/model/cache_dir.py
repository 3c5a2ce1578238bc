"""The engine's cache folder ($MODELYARD_CACHE_DIR, default ~/.cache/modelyard): converted GGUF
models, compiled CPU kernels, parked weights. A module of its own so that the kernel build can
find it without importing the model loader (and transformers)."""

from __future__ import annotations

import os
import time
from pathlib import Path

# A cached file (a kernel build, a checkpoint's narrow records) nobody used for this long goes at
# the next write to its folder: earlier sources, gone CPUs, models taken out of models.yaml.
STALE_AFTER_S = 14 * 24 * 3600


def cache_root() -> Path:
    return Path(os.environ.get("MODELYARD_CACHE_DIR", Path.home() / ".cache" / "modelyard"))


def remove_stale(folder: Path, pattern: str) -> None:
    """Delete the files of ``folder`` matching ``pattern`` not used (touched) for STALE_AFTER_S; a
    process that still maps one keeps it: the file is only unlinked."""
    cutoff = time.time() - STALE_AFTER_S
    for old in folder.glob(pattern):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # removed by a concurrent process, or not ours to remove
            continue
