"""The engine's files in the cache folder (common/cache_dir.py): converted GGUF models, compiled
CPU kernels, parked weights; those nobody used for long go. A module of its own so that the
kernel build can reach it without importing the model loader (and transformers)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

# A cached file (a kernel build, a checkpoint's narrow records) nobody used for this long goes at
# the next write to its folder: earlier sources, gone CPUs, models taken out of models.yaml.
STALE_AFTER_S = 14 * 24 * 3600


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


def write_atomic_text(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name, then renamed: readers see no file or a
    complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
