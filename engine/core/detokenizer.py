"""Turn a sequence's growing token ids into text deltas that are safe to stream.

Two layers of hold-back:
1. Bytes: byte-level BPE splits one character (Chinese, emoji) over several tokens, and a window
   ending inside a character decodes to a trailing U+FFFD. Such text is held until a later token
   completes the character. Each step decodes only a short window (the tokens since the last
   emission plus the previous emission as context, so that tokenizers whose decoding depends on
   the previous token, like SentencePiece's leading space, decode correctly), which keeps the cost
   per token constant instead of re-decoding the whole output.
2. Stop strings: text that could be the start of a stop string is held until the next tokens
   either complete the stop string (it is cut off, the match is reported) or rule it out.

The stop is the first one to appear in the text (the match that ends earliest; of two ending at the
same place, the longer), so the result does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.core.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, as context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams one sequence's output text. Call `add` with each step's new token ids, then `flush`
    when the sequence finishes for another reason than a stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = _decoder(tokenizer)
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: the output cannot extend it
        self._ids = context
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(context)  # end of the text already passed on
        self._held = ""  # decoded text held back because it may begin a stop string
        self.output_text = ""  # everything emitted so far: the choice's text
        self.stop_str: str | None = None  # the stop string that ended the text, if any
        self.finished = False

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Append tokens; return (text safe to emit now, matched stop string or None). After a
        stop-string match or a flush the sequence is finished and further tokens are ignored."""
        if self.finished:
            return "", None
        self._ids.extend(token_ids)
        return self._emit(self._decode_window(complete_only=True), final=False)

    def flush(self) -> str:
        """Release everything held back (an unfinished character decodes to U+FFFD)."""
        if self.finished:
            return ""
        text, _ = self._emit(self._decode_window(complete_only=False), final=True)
        self.finished = True
        return text

    def _decode_window(self, complete_only: bool) -> str:
        """Text of the tokens after the read offset; empty (and nothing consumed) while it ends
        inside a character and `complete_only`."""
        if self._read_offset == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if complete_only and (len(window) <= len(before) or window.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(before) :]

    def _emit(self, new_text: str, final: bool) -> tuple[str, str | None]:
        if not self._stops:
            self.output_text += new_text
            return new_text, None
        text = self._held + new_text
        match = _first_stop(text, self._stops)
        if match is not None:
            start, stop = match
            delta = text[: start + len(stop)] if self._include_stop else text[:start]
            self._held = ""
            self.stop_str = stop
            self.finished = True
        else:
            hold = 0 if final else _stop_prefix_suffix_len(text, self._stops)
            delta, self._held = text[: len(text) - hold], text[len(text) - hold :]
        self.output_text += delta
        return delta, self.stop_str


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """ids -> text without special tokens and without transformers' clean-up of spaces. For fast
    tokenizers that is their Rust decoder's own answer: calling it directly skips transformers'
    argument conversion, two thirds of a decode's cost here (every output token decodes twice)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string whose first occurrence ends earliest (longest on a tie)."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[1], best[2])


def _stop_prefix_suffix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
