"""engine.model.gguf_tokenizer (with gguf_merges and gguf_reads) converts a GGUF's tokenizer and
config as transformers does: the loader's conversion writes the same files, byte for byte, as
transformers' own (AutoConfig, AutoTokenizer, save_pretrained), for both real GGUFs and for tiny
ones covering each path; the config reads as with gguf's own reader; the merges derived from a
vocabulary are generate_merges', in its order."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import SentencePieceBPETokenizer, Tokenizer
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import generate_merges

from engine.model import kept_tokenizers, loader
from engine.model.cpu.gguf_file import GgufFile
from engine.model.gguf_merges import derived_merges
from engine.model.gguf_reads import fast_gguf_reads
from scripts.tiny_models import _CORPUS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from tests.conftest import GEMMA_GGUF, SMOLLM2_GGUF

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6
Vocabulary = dict[str, list]  # tokens, and types, scores or merges as llama.cpp writes them


def _write_gguf(
    path: Path,
    architecture: str,
    model: str,
    vocabulary: Vocabulary,
    ids: dict[str, int],
    flags: dict[str, bool] | None = None,
    pre: str | None = None,
    template: str | None = None,
    states_size: bool = False,
) -> Path:
    """A GGUF of no tensors: the few keys a config needs (with ``states_size``, the vocabulary
    size too) and a tokenizer of ``model``."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_embedding_length(16)
    writer.add_head_count(2)
    if states_size:
        writer.add_vocab_size(len(vocabulary["tokens"]))
    writer.add_tokenizer_model(model)
    writer.add_token_list(vocabulary["tokens"])
    for key, add in (
        ("types", writer.add_token_types),
        ("scores", writer.add_token_scores),
        ("merges", writer.add_token_merges),
    ):
        if key in vocabulary:
            add(vocabulary[key])
    for name, index in ids.items():
        getattr(writer, f"add_{name}_token_id")(index)
    for name, on in (flags or {}).items():
        getattr(writer, f"add_add_{name}_token")(on)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece(specials: list[str]) -> Vocabulary:
    """A SentencePiece-style vocabulary (what llama.cpp writes as "llama"): control tokens, byte
    tokens, pieces by rank with tied scores, user-defined tokens (spaces and newlines among
    them), and a piece listed twice (it keeps its last id)."""
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(_CORPUS * 4, vocab_size=400, show_progress=False)
    vocab = trained.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    user = ["\n", "\n\n", "  ", "   ", " \n", "\t", "<think>"]
    head = specials + [f"<0x{b:02X}>" for b in range(256)]
    return {
        "tokens": [*head, *pieces, *user, "🤖", pieces[-1]],
        "types": [_CONTROL] * len(specials)
        + [_BYTE] * 256
        + [1] * len(pieces)
        + [_USER_DEFINED] * len(user)
        + [1, 1],
        "scores": [0.0] * len(head)
        + [-float(i % 40) for i in range(len(pieces))]
        + [0.0] * len(user)
        + [-1.0, -0.5],
    }


def _byte_level() -> Vocabulary:
    """The tiny models' byte-level BPE as llama.cpp writes it ("gpt2"), with a control token
    outside the byte alphabet (a mislabel transformers skips), a user-defined token and one
    spelled outside the byte alphabet."""
    saved = json.loads(build_tokenizer().backend_tokenizer.to_str())
    vocab = saved["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    return {
        "tokens": [*tokens, "<|a b|>", "<tool>", "é"],
        "types": [_CONTROL if t in SPECIAL_TOKENS else 1 for t in tokens]
        + [_CONTROL, _USER_DEFINED, 1],
        "merges": [m if isinstance(m, str) else " ".join(m) for m in saved["model"]["merges"]],
    }


_VOCABULARIES = {
    "gemma": lambda: _sentencepiece(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<eot>"]),
    "llama": lambda: _sentencepiece(["<unk>", "<s>", "</s>"]),
    "bytes": _byte_level,
}
_IDS = {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
_TINY: dict[str, tuple[str, str, str, dict[str, object]]] = {
    # name: architecture, tokenizer model, vocabulary, other keys of the GGUF
    "gemma3": ("gemma3", "llama", "gemma", {"ids": {"bos": 2, "eos": 1, "unk": 3, "pad": 0}}),
    "gemma3-eos": ("gemma3", "llama", "gemma", {"ids": {"eos": 1}, "flags": {"eos": True}}),
    "gemma2-no-bos": ("gemma2", "llama", "gemma", {"ids": {"bos": 2}, "flags": {"bos": False}}),
    "llama-sp": ("llama", "llama", "llama", {"ids": {"bos": 1, "eos": 2, "unk": 0}}),
    "llama-bl": (
        "llama",
        "gpt2",
        "bytes",
        {"ids": _IDS, "pre": "smollm", "template": CHAT_TEMPLATE, "states_size": True},
    ),
    "llama-bl-split": (
        "llama",
        "gpt2",
        "bytes",
        {"ids": {"eos": 2}, "flags": {"bos": True}, "pre": "llama-bpe"},
    ),
    # a tokenizer class gguf_tokenizer does not follow: transformers converts it
    "qwen2-bl": ("qwen2", "gpt2", "bytes", {"ids": {"eos": 2}}),
}


def _tiny_gguf(folder: Path, name: str) -> Path:
    architecture, model, vocabulary, keys = _TINY[name]
    folder.mkdir()
    path = folder / f"{name}.gguf"
    return _write_gguf(path, architecture, model, _VOCABULARIES[vocabulary](), **keys)  # type: ignore[arg-type]


def _transformers_conversion(path: Path, target: Path) -> PreTrainedTokenizerFast:
    """What the loader wrote before engine.model.gguf_tokenizer: transformers' conversion (its
    config read through fast_gguf_reads, checked on its own below)."""
    with fast_gguf_reads(path, GgufFile(path, read_strings=True)):
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return tokenizer


class _Conversions:
    """Each GGUF converted once by transformers and once by the loader (the real files take
    transformers seconds), kept for every test of the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[Path, Path, PreTrainedTokenizerFast]] = {}
        self.backends: dict[str, Tokenizer | None] = {}  # what the loader's conversion built

    def of(self, name: str) -> tuple[Path, Path, PreTrainedTokenizerFast]:
        if name not in self.done:
            real = {"gemma3-270m": GEMMA_GGUF, "smollm2": SMOLLM2_GGUF}.get(name)
            if real is not None and not real.exists():
                pytest.skip(f"{real.name} not fetched")
            path = real or _tiny_gguf(self.root / name, name)
            ours = self.root / f"{name}-ours"
            self.backends[name] = loader._convert_gguf(path, ours)
            theirs = self.root / f"{name}-transformers"
            self.done[name] = (ours, theirs, _transformers_conversion(path, theirs))
        return self.done[name]


@pytest.fixture(scope="module")
def conversions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Conversions]:
    yield _Conversions(tmp_path_factory.mktemp("conversions"))


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2", *_TINY])
def test_the_loader_writes_what_transformers_writes(name: str, conversions: _Conversions) -> None:
    """Every file of the cached copy: config, tokenizer, its settings, the chat template."""
    ours, theirs, _ = conversions.of(name)
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    for file in files:
        assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2", "llama-sp", "llama-bl-split"])
def test_the_converted_tokenizer_encodes_as_transformers(
    name: str, conversions: _Conversions
) -> None:
    """Equal files make equal tokenizers; this checks what the engine loads from them on text
    that exercises each part: special tokens, byte fallback, runs of spaces, digits, emoji.
    Both ways the engine builds one: from the file, and around the conversion's own tokenizer
    (an engine's first start), which serialises as the file does."""
    ours, _, reference = conversions.of(name)
    built = kept_tokenizers.converted_tokenizer(ours)
    backend = conversions.backends[name]
    assert backend is not None  # every tokenizer here is one the loader converts itself
    kept = kept_tokenizers.converted_tokenizer(ours, backend)
    assert kept.backend_tokenizer is backend
    assert kept.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert kept.special_tokens_map == built.special_tokens_map
    assert kept.chat_template == built.chat_template
    specials = "".join(reference.all_special_tokens[:8])
    texts = [
        (Path(__file__).resolve().parents[1] / "data" / "apache-2.0.txt").read_text()[:2000],
        f"{specials} between {specials}x",
        "  two spaces,\tTAB\n\n\nthree newlines   and 1234567 digits",
        "日本語のテキスト 🤖🚀 ünïcödé \u200b zero-width \x00 nul",
    ]
    for text in texts:
        ids = reference(text)["input_ids"]
        assert built(text)["input_ids"] == ids and kept(text)["input_ids"] == ids
        assert built.decode(ids) == reference.decode(ids) == kept.decode(ids)


def test_the_config_reads_as_with_ggufs_own_reader(tmp_path: Path) -> None:
    """fast_gguf_reads leaves the vocabulary out of the fields the config reads: the config is
    still what gguf's GGUFReader gives, with a vocabulary size the architecture's keys state,
    do not state (as Gemma 3's: the tokens counted) or have no key for (GPT-2's)."""
    paths = [_tiny_gguf(tmp_path / name, name) for name in ("llama-bl", "gemma3")]
    paths.append(_write_gguf(tmp_path / "gpt2.gguf", "gpt2", "gpt2", _byte_level(), {"eos": 2}))
    for path in paths:
        file = GgufFile(path, read_strings=True)
        with fast_gguf_reads(path, file):
            fast = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        assert fast.to_json_string() == reference.to_json_string(), path.name
        assert fast.vocab_size == file.arrays["tokenizer.ggml.tokens"].count, path.name


def test_an_unsupported_tokenizer_is_converted_by_transformers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log says why transformers converts a tokenizer (what it writes is checked above)."""
    path = _tiny_gguf(tmp_path / "qwen2", "qwen2-bl")
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loader._convert_gguf(path, tmp_path / "converted")
    assert "with transformers: transformers builds it with Qwen2Tokenizer" in caplog.text
    assert (tmp_path / "converted" / "tokenizer.json").is_file()


_PIECES = st.text(alphabet="ab▁é日🤖 \n", max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_PIECES, st.sampled_from([0.0, -1.0, -2.5, 3.0])), max_size=40))
def test_derived_merges_are_generate_merges(vocabulary: list[tuple[str, float]]) -> None:
    """Every split into two pieces, ranked by score, then longer left, then longer right, the
    vocabulary's order among equals; a piece listed twice takes its last score and id."""
    vocab = {piece: index for index, (piece, _) in enumerate(vocabulary)}
    scores = dict(vocabulary)
    ranks = np.array([scores[p] for p in vocab], np.float64)
    assert derived_merges(list(vocab), ranks) == generate_merges(vocab, scores)
