"""``gateway.engine_logs``: where the engines' log files go (relative to the file's folder) and
how they rotate; the default folder is the gateway's own under the cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.schema import EngineLogSettings
from gateway.engines.logs import log_folder
from tests.gateway.config.documents import document, gateway_doc, parsed, problems_of


def test_the_defaults_and_the_default_folder(monkeypatch, tmp_path):
    settings = parsed(document()).gateway.engine_logs
    assert settings == EngineLogSettings(dir=None, max_bytes=10 * 2**20, files=3)
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path))
    assert log_folder(settings, "127.0.0.1", 8000) == tmp_path / "logs" / "127.0.0.1-8000"


def test_a_relative_folder_starts_from_the_files_folder(tmp_path):
    doc = gateway_doc(engine_logs={"dir": "logs/engines", "max_bytes": "1MiB", "files": 1})
    settings = parsed(doc, base_dir=tmp_path).gateway.engine_logs
    assert settings == EngineLogSettings(str(tmp_path / "logs/engines"), 2**20, 1)
    assert log_folder(settings, "127.0.0.1", 8000) == tmp_path / "logs/engines"
    absolute = parsed(gateway_doc(engine_logs={"dir": "/var/log/my"}), base_dir=tmp_path)
    assert absolute.gateway.engine_logs.dir == "/var/log/my"
    home = parsed(gateway_doc(engine_logs={"dir": "~/logs"}), base_dir=tmp_path)
    assert home.gateway.engine_logs.dir == str(Path.home() / "logs")


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({"max_bytes": 100}, "engine_logs.max_bytes: must be at least 1024 bytes"),
        ({"max_bytes": "lots"}, "engine_logs.max_bytes: invalid size"),
        ({"files": 0}, "engine_logs.files: must be >= 1"),
        ({"files": 101}, "engine_logs.files: must be >= 1 and <= 100"),
        ({"dir": ""}, "engine_logs.dir: must be a non-empty string"),
        ({"rotate": True}, "engine_logs.rotate: unknown key"),
    ],
)
def test_bad_values_are_named(section, problem):
    (found,) = problems_of(gateway_doc(engine_logs=section))
    assert f"models.yaml: gateway.{problem}" in found
