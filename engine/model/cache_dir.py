"""The engine's files in the cache folder (common/cache_dir.py): converted GGUF models, compiled
CPU kernels, parked weights; those nobody used for long go. A module of its own so that the
kernel build can reach it without importing the model loader (and transformers)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def replaced_atomically(path: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary file beside ``path`` for the body to write, renamed onto ``path`` once the
    body ends without an error (readers see no file or a complete one), removed in any case."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield Path(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def write_atomic_text(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name, then renamed."""
    with replaced_atomically(path) as temp:
        temp.write_text(text)


_behind: list[threading.Thread] = []  # writes started by write_behind, not yet joined


def write_behind(write: Callable[[], None]) -> None:
    """Run ``write``, the writing of a cache file that this load does not read back, on a thread
    of its own while the load goes on: a file's write lets go of the GIL, and on a VM each fresh
    page of the page cache faults (~2.4 ms a MB: an untied embedding's records, or every record
    where the packed file could not be written).
    `wait_for_writes` joins them: an engine before it reports ready, a load before it reads a
    cache an earlier load of the same process may still be writing."""
    thread = threading.Thread(target=write, name="cache-write")
    thread.start()
    _behind.append(thread)


def wait_for_writes() -> None:
    while _behind:
        _behind.pop().join()
