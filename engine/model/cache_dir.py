"""The engine's cache folder ($MODELYARD_CACHE_DIR, default ~/.cache/modelyard): converted GGUF
models, compiled CPU kernels, parked weights. A module of its own so that the kernel build can
find it without importing the model loader (and transformers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MODELYARD_CACHE_DIR", Path.home() / ".cache" / "modelyard"))
