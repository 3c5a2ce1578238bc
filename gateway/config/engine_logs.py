"""``gateway.engine_logs``: where each engine replica's output goes (a folder, relative to the
file's) and how its files rotate. Defaults come from schema.py."""

from __future__ import annotations

from pathlib import Path

from gateway.config.reader import Reader
from gateway.config.schema import EngineLogSettings

MIN_FILE_BYTES = 1024  # below this, rotation would leave no room for a line


def read_engine_logs(r: Reader, base_dir: Path) -> EngineLogSettings:
    d = EngineLogSettings()
    folder = r.string("dir")
    max_bytes = r.size("max_bytes", d.max_bytes)
    if max_bytes is not None and max_bytes < MIN_FILE_BYTES:
        r.error("max_bytes", f"must be at least {MIN_FILE_BYTES} bytes")
        max_bytes = d.max_bytes
    settings = EngineLogSettings(
        # an absolute folder (or ~/...) stays as it is
        dir=str(base_dir / Path(folder).expanduser()) if folder else None,
        max_bytes=max_bytes or d.max_bytes,
        files=r.integer("files", d.files, maximum=100),
    )
    r.finish()
    return settings
