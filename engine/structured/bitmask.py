"""Token bitmasks: one bit per vocabulary entry (1 = allowed), 32 to an int32 word, lowest bit
first, as llguidance fills them; applied to score rows by adding -inf to the disallowed entries.

The mask is expanded through a table of 256 rows (one per byte value) of 8 additive biases, 0 or
-inf: one gather and one add per row, several times quicker on the CPU than shifting bits,
gathering bools or xgrammar's kernel (docs/PERFORMANCE.md#structured-outputs).
"""

from __future__ import annotations

import sys

import llguidance
import torch

# The table reads each int32 word as four bytes, lowest first.
assert sys.byteorder == "little", "token bitmasks are expanded byte by byte, little-endian"

_BIAS_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A mask of `rows` rows allowing nothing yet (the matchers fill it)."""
    return torch.zeros((rows, bitmask_words(vocab_size)), dtype=torch.int32)


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """``matcher``'s allowed next tokens into row ``row`` of ``bitmask``. llguidance.torch has the
    same few lines, but importing it compiles a kernel with torch.compile (dynamo and inductor:
    2.5 s of an engine's start) that the engine never calls."""
    words = _checked(bitmask)[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def fill_rows(
    executor: llguidance.LLExecutor,
    matchers: list[tuple[llguidance.LLMatcher, int]],
    bitmask: torch.Tensor,
) -> None:
    """Each (matcher, row)'s allowed next tokens into its row, on the executor's threads."""
    words = _checked(bitmask).shape[1]
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, bitmask.shape[0])


def _checked(bitmask: torch.Tensor) -> torch.Tensor:
    """The raw-pointer fills write [rows, words] int32s in place: refuse anything else."""
    if not (
        bitmask.dtype == torch.int32
        and bitmask.dim() == 2
        and bitmask.is_cpu
        and bitmask.is_contiguous()
    ):
        raise ValueError("a bitmask is a contiguous [rows, words] int32 CPU tensor")
    return bitmask


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set, else -inf."""
    key = (dtype, device)
    table = _BIAS_TABLES.get(key)
    if table is None:
        byte = torch.arange(256).unsqueeze(1)
        allowed = (byte >> torch.arange(8)) & 1 == 1
        table = torch.where(allowed, 0.0, float("-inf")).to(dtype=dtype, device=device)
        _BIAS_TABLES[key] = table
    return table


class BitmaskApplier:
    """Applies bitmasks to score rows into buffers it keeps from call to call: a batch's masks
    and masked scores are megabytes, and fresh allocations that size cost page faults each step
    (docs/PERFORMANCE.md#structured-outputs)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def apply(self, scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`scores` with the disallowed tokens of `rows` (bitmask row k applies to rows[k]) at
        -inf, in a buffer of this applier: valid until its next call. `scores` stay as they were
        (the logprobs read them)."""
        device, dtype = scores.device, scores.dtype
        num_rows, vocab = len(rows), scores.shape[1]
        bitmask = bitmask.to(device)
        index = self._buffer("index", bitmask.numel() * 4, torch.int32, device)
        index.copy_(bitmask.contiguous().view(torch.uint8).view(-1))
        bias = self._buffer("bias", index.numel() * 8, dtype, device).view(-1, 8)
        torch.index_select(_bias_table(dtype, device), 0, index, out=bias)
        bias = bias.view(num_rows, -1)[:, :vocab]
        out = self._buffer("scores", scores.numel(), dtype, device).view(scores.shape)
        if rows == list(range(scores.shape[0])):
            return torch.add(scores, bias, out=out)
        out.copy_(scores)
        return out.index_add_(0, torch.tensor(rows, dtype=torch.long, device=device), bias)
