"""Per-request sampling parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate, compiled into a grammar by the engine.
    ``value``: the JSON Schema as canonical JSON text (json_schema), the pattern (regex), a JSON
    array of the allowed strings (choice), the EBNF grammar (grammar); empty for json_object. Its
    text is the compile cache's key."""

    kind: StructuredKind
    value: str = ""


@dataclass
class SamplingParams:
    """How to pick tokens for one request (all ``n`` choices share these)."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token plus k top alternatives
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # constrained decoding (engine.structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad parameter."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (
                len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "must be up to 16 non-empty strings",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be non-negative token ids",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                "logprobs",
                f"must be between 0 and {MAX_TOP_LOGPROBS}",
            ),
        ]
        for ok, param, problem in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {problem}", param=param)
