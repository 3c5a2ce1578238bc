"""The servers a case is written for: the paths and body limit both have, and a ``Profile`` (what
the generator knows of one server) for each kind."""

from __future__ import annotations

from dataclasses import dataclass

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
BODY_LIMIT = 4 * 2**20  # both servers' default max_body_bytes


@dataclass(frozen=True)
class Profile:
    """What the generator knows about the server it writes for."""

    name: str  # "gateway" | "engine": part of every case's seed
    model: str  # a served model name
    aliases: tuple[str, ...] = ()  # other valid names for it
    unavailable_model: str | None = None  # gateway: a model whose only upstream is down
    api_key: str | None = None  # gateway: a valid client key (sent unless the case fuzzes it)
    admin_key: str | None = None
    admin_paths: tuple[str, ...] = ()
    tokenizer_paths: tuple[str, ...] = ()  # engine: /tokenize, /detokenize
    get_paths: tuple[str, ...] = ("/v1/models", "/health", "/ready", "/metrics")
    max_string: int = 2**20  # the "huge string" edge value; the engine tokenizes it
    max_tokens: int = 4  # valid bodies ask for at most this many tokens
    vocab: int = 100  # token ids below this are valid


def gateway_profile(api_key: str, admin_key: str) -> Profile:
    """Matches tests/test_fuzz.py's and scripts/fuzz.py's gateway: model m1 (alias default) on
    the mock upstream, model ``down`` on a port nothing listens on."""
    return Profile(
        name="gateway",
        model="m1",
        aliases=("default",),
        unavailable_model="down",
        api_key=api_key,
        admin_key=admin_key,
        admin_paths=(
            "/admin/backends",
            "/admin/reload",
            "/admin/drain",
            "/admin/prometheus/targets",
        ),
    )


def engine_profile(model: str = "tiny") -> Profile:
    # 64 KB "huge" strings: the tokenizer's time grows with them and most other cases take ms.
    return Profile(
        name="engine", model=model, tokenizer_paths=(TOKENIZE, DETOKENIZE), max_string=2**16
    )
