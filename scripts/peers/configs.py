"""The configurations bench_peers compares on each GGUF: Modelyard's engine on the file's own
blocks (``modelyard``: --quantization auto, the engine's default on a GGUF) and llama-server on
the same file (``llama``), for any file; and on request the engine at another --quantization and
llama-server on an F16 requantization of the file. A configuration that does not apply (an engine
flag that does not exist yet, ``llama-q4_1`` on a file that is not Q4_1) is skipped with the
reason, not failed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    name: str
    server: str  # "modelyard" or "llama"
    fmt: str  # the weight format the bandwidth bound counts (scripts.peers.weights)
    quantization: str | None = None  # Modelyard's --quantization value
    model: str = "file"  # llama-server: "file" (the GGUF given) or "f16" (requantized from it)
    file_type: str | None = None  # only for a GGUF of this type (the name promises it)


CONFIGS = {
    c.name: c
    for c in (
        Config("modelyard", "modelyard", "auto", quantization="auto"),
        Config("llama", "llama", "gguf"),
        # SmolLM2's Q4_1 comparisons: modelyard-auto is modelyard, llama-q4_1 is llama on a Q4_1
        Config("modelyard-auto", "modelyard", "auto", quantization="auto"),
        Config("modelyard-int4", "modelyard", "int4", quantization="int4"),
        Config("modelyard-int8", "modelyard", "int8", quantization="int8"),
        Config("modelyard-fp32", "modelyard", "fp32", quantization="none"),
        Config("llama-q4_1", "llama", "gguf", file_type="Q4_1"),
        Config("llama-f16", "llama", "f16", model="f16"),
    )
}
DEFAULT_CONFIGS = ("modelyard", "llama")


def same_file_llama(names: list[str]) -> str | None:
    """Of ``names``, the first llama-server configuration on the file itself (not requantized):
    what a Modelyard configuration's ratios compare with."""
    return next(
        (n for n in names if CONFIGS[n].server == "llama" and CONFIGS[n].model == "file"), None
    )


def file_type_mismatch(config: Config, file_type: str) -> str | None:
    """Why ``config`` does not apply to a file of ``file_type``, or None when it does."""
    if config.file_type is not None and config.file_type != file_type:
        return f"the file is {file_type}, not {config.file_type} (use llama)"
    return None


def parse_configs(text: str) -> list[Config]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}"
        )
    return [CONFIGS[n] for n in dict.fromkeys(names)]


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad concurrencies {text!r}: e.g. 1,4,16")
    return sorted(set(values))


def engine_quantizations() -> list[str] | None:
    """The --quantization choices of ``python -m engine``; None while the flag does not exist."""
    from engine.serving.cli import build_parser

    for action in build_parser()._actions:
        if "--quantization" in action.option_strings:
            return list(action.choices or [])
    return None


def engine_flags(config: Config, choices: list[str] | None) -> tuple[list[str] | None, str | None]:
    """(the engine flags of ``config``, None) or (None, why it is skipped). Without the flag the
    engine serves fp32, so "none" is then the bare command."""
    if choices is None:
        if config.quantization == "none":
            return [], None
        return None, "python -m engine has no --quantization flag yet"
    if config.quantization not in choices:
        return None, f"--quantization {config.quantization} is not one of {choices}"
    return ["--quantization", str(config.quantization)], None
