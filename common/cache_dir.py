"""Modelyard's cache folder, ``$MODELYARD_CACHE_DIR`` (default ``~/.cache/modelyard``): the
engines keep converted models, compiled kernels and park files there, the gateway its engines'
log files (``logs/``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MODELYARD_CACHE_DIR", Path.home() / ".cache" / "modelyard"))
