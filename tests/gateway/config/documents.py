"""models.yaml documents for the config tests, and what reading them reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError, FleetConfig, load_config, parse_config

EXTERNAL = {"name": "x", "upstreams": ["http://127.0.0.1:9"]}  # the smallest valid model


def document(models: list[dict[str, Any]] | None = None, **sections: Any) -> dict[str, Any]:
    """A document with ``models`` (default: one external model) and the given sections."""
    return {**sections, "models": models if models is not None else [EXTERNAL]}


def gateway_doc(**settings: Any) -> dict[str, Any]:
    """A document whose ``gateway`` section holds ``settings``."""
    return document(gateway=settings)


def parsed(document: Any, base_dir: Path | None = None) -> FleetConfig:
    return parse_config(document, base_dir=base_dir)


def problems_of(document: Any, base_dir: Path | None = None) -> list[str]:
    """Every problem parse_config reports (file name models.yaml)."""
    with pytest.raises(ConfigError) as info:
        parse_config(document, base_dir=base_dir)
    return info.value.problems


def write(tmp_path: Path, document: Any, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def problems(tmp_path: Path, document: Any) -> list[str]:
    """Every problem load_config reports for ``document`` written to tmp_path/models.yaml."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, document))
    return info.value.problems
