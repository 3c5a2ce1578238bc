"""The tokenizers an engine template builds for the engines it forks (engine/template/tokenizers.py
over engine/model/kept_tokenizers.py): which engines get one, that an engine finds it built, and
which unused ones the template drops. A real template and engines: tests/gateway/
test_engine_template.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.model import kept_tokenizers
from engine.model.kept_tokenizers import FROM_FILE, converted_tokenizer, kept_tokenizer
from engine.model.loader import converted_gguf_dir
from engine.template import tokenizers
from engine.template.tokenizers import TokenizerShelf

MIB = 2**20


@pytest.fixture(autouse=True)
def nothing_kept(monkeypatch):
    monkeypatch.setattr(kept_tokenizers, "_kept", {})


@pytest.fixture
def smollm2_folder(smollm2_gguf: Path) -> Path:
    return converted_gguf_dir(smollm2_gguf)


def test_an_engine_of_a_converted_gguf_finds_its_tokenizer_built_once(smollm2_gguf, smollm2_folder):
    shelf = TokenizerShelf()
    folder, line = shelf.prepare(["--model", str(smollm2_gguf), "--port", "1"], None)
    assert folder == smollm2_folder and line is not None and "built for its engines" in line
    tokenizer, built_from = kept_tokenizer(folder)  # what the forked engine's loader calls
    assert built_from == FROM_FILE
    again, line = shelf.prepare(["--model", str(smollm2_gguf)], None)
    assert again == folder and line is None and kept_tokenizer(folder) == (tokenizer, FROM_FILE)
    fresh = converted_tokenizer(folder)
    text = "Hello, world! <|im_start|>user\n 1234 ünï 🤖"
    assert tokenizer(text)["input_ids"] == fresh(text)["input_ids"]


def test_the_gguf_is_found_as_the_engine_finds_it(smollm2_gguf, smollm2_folder):
    """A path relative to the engine's working directory; a folder and --gguf-file."""
    shelf = TokenizerShelf()
    relative = ["--model", smollm2_gguf.name]
    assert shelf.prepare(relative, str(smollm2_gguf.parent))[0] == smollm2_folder
    named = ["--model", str(smollm2_gguf.parent), "--gguf-file", smollm2_gguf.name]
    assert shelf.prepare(named, None)[0] == smollm2_folder


def test_engines_it_cannot_place_build_their_own(smollm2_gguf, tiny_llama_dir, tmp_path, capsys):
    """Never converted (the engine's first start converts it), a model folder (AutoTokenizer's),
    a command line that does not parse (the engine reports it): nothing built, nothing said."""
    unseen = tmp_path / "unseen.gguf"
    shutil.copyfile(smollm2_gguf, unseen)  # same bytes, but this path was never converted
    shelf = TokenizerShelf()
    for argv in (["--model", str(unseen)], ["--model", str(tiny_llama_dir)],
                 ["--model"], ["--port", "1"], ["--model", str(tmp_path / "missing.gguf")],
                 ["--help"]):  # fmt: skip
        assert shelf.prepare(argv, None) == (None, None), argv
    assert capsys.readouterr() == ("", "")
    assert kept_tokenizers._kept == {} and shelf.held_bytes() == 0


@pytest.fixture
def two_folders(smollm2_folder, tmp_path, monkeypatch) -> dict[str, Path]:
    """Two converted folders, each engine command line naming one by its --model; every build
    measured at 100 MiB."""
    other = tmp_path / "other"
    shutil.copytree(smollm2_folder, other)
    folders = {"a": smollm2_folder, "b": other}
    monkeypatch.setattr(tokenizers, "_converted_folder", lambda argv, cwd: folders[argv[1]])
    resident = iter(range(0, 100 * MIB * 100, 100 * MIB))  # read before and after a build
    monkeypatch.setattr(tokenizers, "rss_bytes", lambda: next(resident))
    return folders


def test_a_tokenizer_stays_while_an_engine_uses_it(two_folders):
    shelf = TokenizerShelf(unused_bytes=0)
    folder, _ = shelf.prepare(["--model", "a"], None)
    shelf.forked(11, folder)
    shelf.forked(12, shelf.prepare(["--model", "a"], None)[0])
    assert shelf.held_bytes() == 100 * MIB
    assert shelf.exited(11) == [] and kept_tokenizer(folder)[1]
    assert shelf.exited(12) == [f"tokenizer in {folder} dropped: no engine uses it"]
    assert shelf.held_bytes() == 0 and not kept_tokenizer(folder)[1]  # built again
    assert shelf.exited(999) == []  # an engine forked without one


def test_unused_tokenizers_beyond_the_bound_go_least_recently_used_first(two_folders):
    a, b = two_folders["a"], two_folders["b"]
    shelf = TokenizerShelf(unused_bytes=150 * MIB)
    shelf.forked(1, shelf.prepare(["--model", "a"], None)[0])
    shelf.forked(2, shelf.prepare(["--model", "b"], None)[0])
    assert shelf.exited(1) == []  # a unused: 100 MiB fit
    assert shelf.exited(2) == [f"tokenizer in {a} dropped: no engine uses it"]
    assert shelf.held_bytes() == 100 * MIB
    assert kept_tokenizer(b)[1] and not kept_tokenizer(a)[1]


def test_an_on_demand_models_tokenizer_is_built_ahead_while_the_unused_ones_fit(two_folders):
    """Ahead of a first start, a tokenizer is built only while the unused ones fit: one that
    does not is dropped again, never one an engine used more lately."""
    a = two_folders["a"]
    shelf = TokenizerShelf(unused_bytes=150 * MIB)
    line = shelf.prepare_ahead(["--model", "a"], None)
    assert line is not None and line.endswith("ahead of its first start")
    assert shelf.prepare_ahead(["--model", "a"], None) is None  # built already
    line = shelf.prepare_ahead(["--model", "b"], None)  # 200 MiB unused: b goes again, not a
    assert line is not None and "dropped again" in line
    assert kept_tokenizer(a)[1] and shelf.held_bytes() == 100 * MIB
    shelf.forked(7, shelf.prepare(["--model", "a"], None)[0])  # a in use: 0 unused, room for b
    assert shelf.prepare_ahead(["--model", "b"], None).endswith("ahead of its first start")
    full = TokenizerShelf(unused_bytes=0)  # no room at all: nothing is built
    assert full.prepare_ahead(["--model", "a"], None) is None and full.held_bytes() == 0
