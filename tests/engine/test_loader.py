"""Model loading: clear errors, dtype/device choice, and the GGUF conversion cache."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import T5Config, ViTConfig

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model import kept_tokenizers, loader
from engine.model.loader import converted_gguf_dir, load_model
from tests.conftest import GEMMA_GGUF


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(path))
    return path


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(EngineConfig(model=str(tmp_path / "nowhere")))


def test_folder_without_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(EngineConfig(model=str(tmp_path)))


def test_missing_gguf_file_in_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(EngineConfig(model=str(tmp_path), gguf_file="model.gguf"))


@pytest.mark.parametrize("config", [ViTConfig(), T5Config()], ids=["vision", "encoder-decoder"])
def test_unsupported_architecture(tmp_path: Path, config: object) -> None:
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(EngineConfig(model=str(tmp_path)))


def test_gguf_without_gguf_package(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"GGUF" + bytes(64))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="needs the `gguf` package"):
        load_model(EngineConfig(model=str(gguf_path)))


def test_local_folder_loads_in_fp32_on_cpu(tiny_llama_dir: Path) -> None:
    loaded = load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu"))
    assert loaded.dtype == torch.float32
    assert loaded.device.type == "cpu"
    assert loaded.eos_token_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    assert not loaded.model.training


def test_explicit_dtype(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit --dtype is the weights' dtype (on a CPU that runs bf16 natively: elsewhere
    bf16 falls back to fp32, tests/engine/test_cpu_isa.py)."""
    monkeypatch.setattr(loader, "native_bf16", lambda: True)
    loaded = load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="bfloat16"))
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(EngineConfig(model=str(tiny_llama_dir), dtype="float8"))


class _FakeConverter:
    """Stands in for transformers' (slow) GGUF conversion; records each call."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, gguf_path: Path, target: Path) -> None:
        self.calls.append(gguf_path)
        target.mkdir(parents=True)
        (target / "config.json").write_text(json.dumps({"from": gguf_path.name}))


def test_gguf_cache_keyed_by_content(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert = _FakeConverter()
    monkeypatch.setattr(loader, "_convert_gguf", convert)
    hashes: list[Path] = []
    real_hash = loader.file_sha256
    monkeypatch.setattr(loader, "file_sha256", lambda p: hashes.append(p) or real_hash(p))
    original = tmp_path / "a.gguf"
    original.write_bytes(os.urandom(3000))

    first = converted_gguf_dir(original)
    assert convert.calls == [original]
    assert first.parent == cache_dir / "gguf-metadata" and first.name == real_hash(original)
    hashes.clear()
    assert converted_gguf_dir(original) == first  # restart: no conversion, no re-hashing
    assert convert.calls == [original] and hashes == []

    copy = tmp_path / "copy.gguf"  # same bytes elsewhere: converted beside the hash, then
    copy.write_bytes(original.read_bytes())  # found converted: the same cached copy
    assert converted_gguf_dir(copy) == first
    assert convert.calls == [original, copy]
    assert json.loads((first / "config.json").read_text()) == {"from": original.name}

    original.write_bytes(os.urandom(3001))  # new content: a new conversion
    second = converted_gguf_dir(original)
    assert second != first and convert.calls == [original, copy, original]
    assert not list((cache_dir / "gguf-metadata").glob(".tmp-*"))


def test_gguf_changed_during_conversion_is_not_cached(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"one")

    def convert_and_modify(path: Path, target: Path) -> None:
        _FakeConverter()(path, target)
        path.write_bytes(b"two")

    monkeypatch.setattr(loader, "_convert_gguf", convert_and_modify)
    with pytest.raises(ModelLoadError, match="changed while being converted"):
        converted_gguf_dir(gguf_path)
    assert not any((cache_dir / "gguf-metadata").iterdir())


@pytest.mark.smollm2
def test_smollm2_gguf_converts_once_then_loads_fast(
    smollm2_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(EngineConfig(model=str(smollm2_gguf), num_threads=2))
    assert Path(first.source).parent == cache_dir / "gguf-metadata"
    assert first.eos_token_ids == {2}
    assert first.tokenizer.chat_template
    # the conversion's own tokenizer, not one read back from the tokenizer.json it wrote
    kept = kept_tokenizers.kept_tokenizer(Path(first.source))
    assert kept == (first.tokenizer, kept_tokenizers.FROM_CONVERSION)

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    started = time.monotonic()
    second = load_model(EngineConfig(model=str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name))
    assert time.monotonic() - started < 15
    assert second.source == first.source
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert a.is_meta == b.is_meta and (a.is_meta or torch.equal(a, b)), name


def test_the_tokenizer_is_shared_by_threads_without_copies(tiny_llama_dir: Path) -> None:
    """One tokenizer serves the engine thread, the event loop and the prompt thread: loading
    turns truncation and padding off (the only calls that change the Rust tokenizer, which
    refuses them while another thread uses it), and templating, encoding and decoding at once
    from four threads give each call the answer it gives alone."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tiny_llama_dir)
    saved.backend_tokenizer.enable_truncation(8)
    saved.backend_tokenizer.enable_padding(length=16)
    shared = kept_tokenizers.shareable_tokenizer(saved)
    assert shared.backend_tokenizer.truncation is None and shared.backend_tokenizer.padding is None
    tokenizer = load_model(EngineConfig(model=str(tiny_llama_dir), num_threads=1)).tokenizer
    assert tokenizer.backend_tokenizer.truncation is None

    texts = [f"{i} tokens of text, " * (1 + i % 40) for i in range(60)]
    encoded = [tokenizer(t)["input_ids"] for t in texts]
    decoded = [tokenizer.decode(ids) for ids in encoded]
    messages = [[{"role": "user", "content": t}] for t in texts]
    templated = [tokenizer.apply_chat_template(m, tokenize=False) for m in messages]
    failures: list[str] = []

    def repeat(check: Callable[[int], bool]) -> None:
        for round_ in range(20):
            for i in range(len(texts)):
                try:
                    if not check(i):
                        failures.append(f"{check.__name__} {i} in round {round_}")
                except Exception as exc:  # "Already borrowed", or any other
                    failures.append(repr(exc))

    def encode(i: int) -> bool:
        return tokenizer(texts[i])["input_ids"] == encoded[i]

    def decode(i: int) -> bool:
        return tokenizer.decode(encoded[i]) == decoded[i]

    def template(i: int) -> bool:
        return tokenizer.apply_chat_template(messages[i], tokenize=False) == templated[i]

    threads = [threading.Thread(target=repeat, args=(f,)) for f in (encode, decode, template)]
    threads.append(threading.Thread(target=repeat, args=(decode,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


@pytest.mark.skipif(not GEMMA_GGUF.exists(), reason="Gemma 3 GGUF not fetched")
def test_the_kept_tokenizer_drops_transformers_construction_copies() -> None:
    """Gemma's tokenizer class keeps its 262,144-token vocabulary and 514,906 merges as Python
    objects after building the Rust tokenizer from them: the engine's copy lets them go and
    tokenises, templates and decodes as a freshly loaded one does."""
    from transformers import AutoTokenizer

    loaded = load_model(EngineConfig(model=str(GEMMA_GGUF), num_threads=2))
    fresh = AutoTokenizer.from_pretrained(loaded.source)
    assert hasattr(fresh, "_vocab") and hasattr(fresh, "_merges")
    kept = loaded.tokenizer
    assert not hasattr(kept, "_vocab") and not hasattr(kept, "_merges")
    text = (Path(__file__).resolve().parents[1] / "data" / "apache-2.0.txt").read_text()[:6000]
    ids = fresh(text)["input_ids"]
    assert kept(text)["input_ids"] == ids and len(ids) > 1000
    assert kept.decode(ids) == fresh.decode(ids)
    assert kept.convert_ids_to_tokens(ids[:50]) == fresh.convert_ids_to_tokens(ids[:50])
    assert kept.get_vocab() == fresh.get_vocab() and len(kept) == len(fresh)


@pytest.mark.parametrize("gguf", ["smollm2", "gemma3"])
def test_a_converted_tokenizer_behaves_as_autotokenizer_builds_it(
    gguf: str, smollm2_gguf: Path
) -> None:
    """The engine builds a GGUF's cached tokenizer straight from its tokenizer.json; every call
    the engine makes answers as AutoTokenizer's model-class tokenizer (GemmaTokenizer, ...)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf if gguf == "smollm2" else GEMMA_GGUF
    if not path.exists():
        pytest.skip(f"{path} not fetched")
    folder = converted_gguf_dir(path)
    built = kept_tokenizers.converted_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    specials = "".join(reference.all_special_tokens)
    text = (Path(__file__).resolve().parents[1] / "data" / "apache-2.0.txt").read_text()[:3000]
    texts = [text, f"{specials} mixed {specials}x", "  tabs\t\tand\n\nnewlines  ", "日本語 🤖 ünï"]
    for sample in texts:
        for add_special in (True, False):
            ids = reference(sample, add_special_tokens=add_special)["input_ids"]
            assert built(sample, add_special_tokens=add_special)["input_ids"] == ids
            for skip in (True, False):
                assert built.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                )
    assert built.all_special_ids == reference.all_special_ids
    assert (built.bos_token_id, built.eos_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
    )
    assert built.added_tokens_decoder == reference.added_tokens_decoder
    assert built.get_vocab() == reference.get_vocab()
    assert built.chat_template == reference.chat_template
    if reference.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        for generation_prompt in (True, False):
            assert built.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            ) == reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )


def test_a_conversion_reads_the_gguf_once(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config and tokenizer come from one read of the file: gguf's own reader, which
    transformers' config conversion asks for, is not built (test_gguf_tokenizer.py checks the
    config against it), and gguf.GGUFReader is itself again after."""
    import gguf

    reads: list[Path] = []
    read = loader.GgufFile
    monkeypatch.setattr(
        loader, "GgufFile", lambda path, **kw: reads.append(path) or read(path, **kw)
    )

    def unexpected(*args: object, **kwargs: object) -> None:
        pytest.fail("gguf's own reader read the file")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", unexpected)
    original = gguf.GGUFReader
    loader._convert_gguf(smollm2_gguf, tmp_path / "converted")
    assert reads == [smollm2_gguf]
    assert gguf.GGUFReader is original
