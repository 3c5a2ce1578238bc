"""Where a model comes from: a folder, or a GGUF file (named alone or in a folder). A module of its
own so that the CPU fast path can find the GGUF file without importing the loader."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError


def split_source(model: str, gguf_file: str | None) -> tuple[Path, str | None]:
    """(folder, gguf file name in it or None); ``model`` may be a folder or a .gguf file."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist", param="model")
    if path.is_file():
        if gguf_file is not None or path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model path {str(path)!r} is a file; expected a model folder or a .gguf file",
                param="model",
            )
        return path.parent, path.name
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise ModelLoadError(
            f"GGUF file {gguf_file!r} not found in {str(path)!r}", param="gguf_file"
        )
    return path, gguf_file
