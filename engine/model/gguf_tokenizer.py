"""A GGUF's tokenizer built from its metadata as transformers builds it, in a fraction of the time.

transformers (AutoTokenizer.from_pretrained(folder, gguf_file=...), then save_pretrained) takes
~4 s for Gemma 3's 262,144-token vocabulary: the file holds no merges, so it derives them in
Python from every split of every token, then builds its tokenizer classes twice over. This builds
the same tokenizers.Tokenizer and tokenizer_config.json settings directly, the merges with numpy
(gguf_merges.py).

It covers the tokenizer models "llama" (SentencePiece-style BPE: pieces and scores, merges
derived) and "gpt2" (byte-level BPE, merges in the file) for the model types whose AutoTokenizer
class is TokenizersBackend or GemmaTokenizer; any other raises Unsupported, and the loader asks
transformers. The result is what transformers builds from the GGUF alone (tests compare the two
file for file); transformers would also read a tokenizer.json, tokenizer.model or config.json
lying beside the file, which a cache keyed by the file's bytes cannot account for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from transformers import PretrainedConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from engine.model.cpu.gguf_file import GgufFile
from engine.model.gguf_merges import derived_merges

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SPECIAL_IDS = {  # transformers' names of the special tokens, and the keys of their ids
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")  # transformers' order


class Unsupported(Exception):
    """A GGUF tokenizer this module does not build; the message says why."""


@dataclass
class GgufTokenizer:
    """What transformers' save_pretrained writes for the tokenizer of a GGUF."""

    tokenizer: Tokenizer
    settings: dict[str, Any]  # tokenizer_config.json
    chat_template: str | None

    def save_pretrained(self, folder: Path) -> None:
        text = json.dumps(self.settings, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
        if self.chat_template is not None:
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        self.tokenizer.save(str(folder / "tokenizer.json"))


@dataclass
class _Family:
    """What the class transformers builds a tokenizer model with puts in it: the BPE model
    and pipeline, the vocabulary as the model spells it, and the class's own special tokens
    (added whether or not the file has them)."""

    tokenizer: Tokenizer
    pieces: list[str]
    defaults: list[str]
    byte_level: bool = False


def convert(file: GgufFile, config: PretrainedConfig) -> GgufTokenizer:
    """The tokenizer of ``file`` (read with its strings) for a model of ``config``, as
    transformers' AutoTokenizer builds it; Unsupported where this module does not."""
    outer = _auto_class(config)
    family = _family(file)
    tokens = _strings(file, "tokenizer.ggml.tokens")
    settings = _settings(file, tokens, outer)
    tokenizer = family.tokenizer
    _add(tokenizer, family.defaults)
    _add_marked(tokenizer, file, tokens, family)
    split = GGUF_PRE_TOKENIZER_SPLITS.get(str(file.fields.get("tokenizer.ggml.pre")))
    if split is not None:  # the pre-tokenizer the vocabulary's merges were learned with
        tokenizer.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(split), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    _add(tokenizer, [settings[name] for name in _NAMED if settings.get(name) is not None])
    tokenizer.post_processor = _post_processor(tokenizer, file, settings)
    template = file.fields.get("tokenizer.chat_template")
    return GgufTokenizer(tokenizer, settings, template if isinstance(template, str) else None)


def _auto_class(config: PretrainedConfig) -> str:
    """The class AutoTokenizer builds a GGUF's tokenizer with, if one this module follows."""
    auto = TOKENIZER_MAPPING.get(type(config), PreTrainedTokenizerFast)
    name = getattr(auto, "__name__", str(auto))
    if name not in ("TokenizersBackend", "GemmaTokenizer"):
        raise Unsupported(f"transformers builds it with {name}")
    return name


def _family(file: GgufFile) -> _Family:
    model = file.fields.get("tokenizer.ggml.model")
    architecture = file.fields.get("general.architecture")
    if model == "gpt2":
        return _byte_level(file)
    if model == "llama" and architecture in _GEMMA_ARCHITECTURES:
        return _gemma(file)
    if model == "llama" and architecture != "phi3":  # Phi-3 has a variant of its own
        return _sentencepiece(file)
    raise Unsupported(f"tokenizer model {model!r} of architecture {architecture!r}")


def _byte_level(file: GgufFile) -> _Family:
    """GPT2Tokenizer's: the tokens in the byte alphabet (any other spelling respelled), the
    file's merges."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    pieces = [
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())
        for t in _strings(file, "tokenizer.ggml.tokens")
    ]
    if "tokenizer.ggml.merges" not in file.arrays:
        raise Unsupported("byte-level BPE without merges")
    bpe = models.BPE(
        _vocab(pieces),
        _file_merges(file),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _Family(tokenizer, pieces, ["<|endoftext|>"], byte_level=True)


def _gemma(file: GgufFile) -> _Family:
    """GemmaTokenizer's: tokens of spaces only spelled with "▁", as it looks them up, and
    merges derived in the tokens' order in the file (Gemma's scores do not follow it)."""
    pieces = [
        "▁" * len(t) if " " in t and not t.strip() else t
        for t in _strings(file, "tokenizer.ggml.tokens")
    ]
    vocab = _vocab(pieces)
    bpe = models.BPE(
        vocab,
        _merges(file, vocab, lambda: -np.fromiter(vocab.values(), np.float64, len(vocab))),
        dropout=None,
        unk_token="<unk>",
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = _sentencepiece_decoder()
    return _Family(tokenizer, pieces, ["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"])


def _sentencepiece(file: GgufFile) -> _Family:
    """LlamaTokenizer's: a "▁" before the text, merges derived from the tokens' scores."""
    pieces = _strings(file, "tokenizer.ggml.tokens")
    vocab = _vocab(pieces)
    bpe = models.BPE(
        vocab,
        _merges(file, vocab, lambda: _scores(file, len(pieces))[list(vocab.values())]),
        dropout=None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre.Metaspace("▁", prepend_scheme="first", split=False)
    tokenizer.decoder = _sentencepiece_decoder(decoders.Strip(" ", 1, 0))
    return _Family(tokenizer, pieces, ["<s>", "</s>", "<unk>"])


def _merges(
    file: GgufFile, vocab: dict[str, int], ranks: Callable[[], np.ndarray]
) -> list[tuple[str, str]]:
    """The file's merges if it has any, else those derived from the vocabulary's distinct
    pieces, best ``ranks`` first."""
    if "tokenizer.ggml.merges" in file.arrays:
        return _file_merges(file)
    return derived_merges(list(vocab), ranks())


def _scores(file: GgufFile, count: int) -> np.ndarray:
    scores = file.arrays.get("tokenizer.ggml.scores")
    values = None if scores is None else scores.values
    if not isinstance(values, np.ndarray) or len(values) != count or np.isnan(values).any():
        raise Unsupported("no merges, and not a score for each token")
    return values.astype(np.float64)


def _file_merges(file: GgufFile) -> list[tuple[str, str]]:
    merges = [tuple(m.split(" ")) for m in _strings(file, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise Unsupported("a merge that is not two pieces")
    return merges  # type: ignore[return-value]


def _sentencepiece_decoder(*last: decoders.Decoder) -> decoders.Decoder:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *last]
    return decoders.Sequence(steps)


def _vocab(pieces: list[str]) -> dict[str, int]:
    """Piece -> id; a piece listed twice keeps its last id, as transformers' dict does."""
    return {piece: index for index, piece in enumerate(pieces)}


def _strings(file: GgufFile, key: str) -> list[str]:
    array = file.arrays.get(key)
    if array is None or not isinstance(array.values, list):
        raise Unsupported(f"no {key} strings")
    return array.values


def _settings(file: GgufFile, tokens: list[str], outer: str) -> dict[str, Any]:
    """tokenizer_config.json as transformers saves it: the special tokens the file names, the
    class's own (GemmaTokenizer's mask), and what its from_pretrained was given."""
    settings: dict[str, Any] = {"mask_token": "<mask>"} if outer == "GemmaTokenizer" else {}
    for name, key in _SPECIAL_IDS.items():
        index = file.fields.get(key)
        if isinstance(index, int) and not -len(tokens) <= index < len(tokens):
            raise Unsupported(f"{key} {index} is not a token")
        settings[name] = None if index is None else tokens[index]  # type: ignore[index]
    return settings | {
        "backend": "tokenizers",
        "is_local": True,  # from a local folder (always, here) ...
        "local_files_only": True,  # ... and without the hub, as the loader calls it
        "model_max_length": VERY_LARGE_INTEGER,
        "tokenizer_class": outer,
    }


def _add(tokenizer: Tokenizer, tokens: Iterable[str]) -> None:
    """``tokens`` as special added tokens, each once, unless the tokenizer has them already:
    how transformers adds a class's named special tokens."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    new = [t for t in dict.fromkeys(tokens) if t not in added]
    if new:
        tokenizer.add_tokens([AddedToken(t, special=True) for t in new])


def _add_marked(tokenizer: Tokenizer, file: GgufFile, tokens: list[str], family: _Family) -> None:
    """The tokens the file marks control as special tokens, and those it marks user-defined
    (and the vocabulary holds) as plain added tokens, so that neither is cut into pieces; a
    byte-level vocabulary's control token outside the byte alphabet is a mislabel, left out."""
    types = file.arrays.get("tokenizer.ggml.token_type")
    # a list of types shorter than the vocabulary marks the tokens it reaches, as in transformers
    kinds = [] if types is None or types.values is None else types.values.tolist()
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, kinds, strict=False)
        if kind == _CONTROL and (not family.byte_level or set(t) <= alphabet)
    ]
    if control:
        tokenizer.add_special_tokens(control)
    known = set(family.pieces) | {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, kinds, strict=False)
        if kind == _USER_DEFINED and t in known
    ]
    if user_defined:
        tokenizer.add_tokens(user_defined)


def _post_processor(
    tokenizer: Tokenizer, file: GgufFile, settings: dict[str, Any]
) -> processors.TemplateProcessing:
    """BOS and EOS around each sequence where the file asks for them (a SentencePiece
    vocabulary that does not say: BOS, as llama.cpp does) and names the token."""
    sentencepiece = file.fields.get("tokenizer.ggml.model") == "llama"
    bos, eos = settings["bos_token"], settings["eos_token"]
    add_bos = bos is not None and file.fields.get("tokenizer.ggml.add_bos_token", sentencepiece)
    add_eos = eos is not None and file.fields.get("tokenizer.ggml.add_eos_token", False)
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
