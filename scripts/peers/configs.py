"""The configurations bench_peers compares: Modelyard's engine at each --quantization, and
llama-server on the Q4_1 file and its F16 requantization. A configuration whose engine flag does
not exist (yet) is skipped with the reason, not failed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    name: str
    server: str  # "modelyard" or "llama"
    fmt: str  # the weight format the bandwidth bound counts (scripts.peers.weights)
    quantization: str | None = None  # Modelyard's --quantization value
    model: str = "q4_1"  # llama-server: "q4_1" (the GGUF) or "f16" (requantized from it)


CONFIGS = {
    c.name: c
    for c in (
        Config("modelyard-auto", "modelyard", "auto", quantization="auto"),
        Config("modelyard-int4", "modelyard", "int4", quantization="int4"),
        Config("modelyard-int8", "modelyard", "int8", quantization="int8"),
        Config("modelyard-fp32", "modelyard", "fp32", quantization="none"),
        Config("llama-q4_1", "llama", "gguf", model="q4_1"),
        Config("llama-f16", "llama", "f16", model="f16"),
    )
}
LLAMA_SAME_FILE = "llama-q4_1"
# By default Modelyard at int4, int8 and fp32, llama-server at Q4_1 and F16; modelyard-auto (the
# engine's default on a GGUF: each tensor's own block type) on request.
DEFAULT_CONFIGS = ("modelyard-int4", "modelyard-int8", "modelyard-fp32", "llama-q4_1", "llama-f16")


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
