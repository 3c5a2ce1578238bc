"""Pick the next token of every sequence in a batch from its logits row.

The sampler runs once per engine step, so each stage only runs for the rows that need it: an
all-greedy batch without penalties or logprobs is a single max over the logits. Logits arrive in
the model's dtype; what is computed on them (penalties, softmax, logprobs) runs in fp32 on the rows
that need it, while a max reads them as they are (widening to fp32 is exact, so it picks the same
token): a bf16 model no longer converts its whole logits matrix every step (figures:
docs/PERFORMANCE.md#step-bookkeeping).

Sampling is inverse-CDF with one uniform number per row. A seeded row derives its number from
(seed, choice index, output position) alone, so its tokens do not depend on which other sequences
share the batch, on where the row sits in it, or on the global RNG; unseeded rows share one draw
from torch's global generator.

Logprobs are those of the model's raw distribution (log_softmax of the logits before penalties
and temperature), like vLLM's default: they describe what the model predicted, independent of how
the token was then chosen.

Rows of constrained sequences (structured outputs: a grammar matcher on the sequence) get their
disallowed tokens set to -inf on the scores after the penalties, before the greedy or random pick;
the logprobs still read the raw logits. Batches without a constrained row skip this entirely.
"""

from __future__ import annotations

from array import array

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, TokenLogprob
from engine.model.sampling_ops import greedy_tokens, single_threaded
from engine.structured.bitmask import BitmaskApplier, allocate_bitmask
from engine.structured.matcher import BitmaskFiller

# Threads that fill the grammar masks of a batch's constrained rows (llguidance's own pool).
MASK_THREADS = 2

# top_p without top_k looks for the nucleus among this many best tokens first (a partial top-k is
# far cheaper than sorting a 49k vocabulary); rows whose nucleus is larger are sorted in full.
TOP_P_CANDIDATES = 256

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, choice_index: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on its arguments (24 bits: exact in fp32)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ choice_index) ^ position)
    return (h >> 40) / float(1 << 24)


class Sampler:
    """Applies penalties, temperature, top_k / top_p / min_p and draws one token per row."""

    def __init__(self, top_p_candidates: int = TOP_P_CANDIDATES) -> None:
        self.top_p_candidates = top_p_candidates
        self._mask_filler: BitmaskFiller | None = None  # made by the first constrained batch
        self._mask_applier = BitmaskApplier()

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        params = [seq.params for seq in seqs]
        scores = apply_penalties(logits, seqs)
        constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if constrained:
            scores = self._apply_grammars(scores, seqs, constrained)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == len(seqs):
            tokens = greedy_tokens(scores)
        else:
            picked: dict[int, int] = {}
            if greedy:
                best = greedy_tokens(scores[_index(greedy, scores.device)])
                picked.update(zip(greedy, best, strict=True))
            picked.update(
                self._sample(scores, seqs, [i for i, p in enumerate(params) if not p.greedy])
            )
            tokens = [picked[i] for i in range(len(seqs))]
        return tokens, _logprobs(logits, params, tokens)

    def _apply_grammars(
        self, scores: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        """`scores` with each constrained row's disallowed tokens at -inf, in the applier's
        buffer (`scores` stay as they were: they may be the logits the logprobs read)."""
        if self._mask_filler is None:
            self._mask_filler = BitmaskFiller(MASK_THREADS)
        matchers = [matcher for i in rows if (matcher := seqs[i].matcher) is not None]
        bitmask = allocate_bitmask(len(rows), scores.shape[1])
        self._mask_filler.fill(matchers, bitmask)
        # A row that allows nothing (its grammar is at a dead end, or the library gave up on it)
        # is left unmasked rather than all -inf: its pick is then any token, which its matcher
        # refuses, and the core ends the request with the error (engine_core.py).
        dead = ~bitmask.any(dim=1)
        if bool(dead.any()):
            bitmask[dead] = -1
        # One thread: on shared cores a second one's wake-up costs more than it saves, and
        # sometimes milliseconds (docs/PERFORMANCE.md#structured-outputs).
        with single_threaded():
            return self._mask_applier.apply(scores, bitmask, rows)

    def _sample(
        self, scores: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> dict[int, int]:
        """Random draws for `rows`; returns row -> token."""
        vocab = scores.shape[1]
        uniform = dict(zip(rows, _uniforms([seqs[i] for i in rows]), strict=True))
        plain: list[int] = []  # rows without top_k / top_p
        by_width: dict[int, list[int]] = {}  # candidate count -> rows
        for i in rows:
            p = seqs[i].params
            top_k = min(p.top_k, vocab) if p.top_k > 0 else 0
            if p.top_p < 1.0:
                by_width.setdefault(top_k or min(vocab, self.top_p_candidates), []).append(i)
            elif 0 < top_k < vocab:
                by_width.setdefault(top_k, []).append(i)
            else:
                plain.append(i)

        def inputs(group: list[int]) -> tuple[torch.Tensor, list[SamplingParams], torch.Tensor]:
            u = torch.tensor([uniform[i] for i in group], dtype=torch.float32, device=scores.device)
            # rows ascend, so a group as long as the batch is the whole batch: no copy needed
            group_scores = (
                scores if len(group) == len(seqs) else scores[_index(group, scores.device)]
            )
            return group_scores.float(), [seqs[i].params for i in group], u

        picked: dict[int, int] = {}
        if plain:
            picked.update(zip(plain, _sample_plain(*inputs(plain)), strict=True))
        for width, group in by_width.items():
            group_scores, group_params, u = inputs(group)
            tokens, uncovered = _sample_truncated(group_scores, width, group_params, u)
            picked.update(zip(group, tokens, strict=True))
            if uncovered:  # nucleus larger than the candidates: redo those rows on the full sort
                redo = [group[k] for k in uncovered]
                redo_scores, redo_params, redo_u = inputs(redo)
                tokens, _ = _sample_truncated(redo_scores, vocab, redo_params, redo_u)
                picked.update(zip(redo, tokens, strict=True))
        return picked


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _uniforms(seqs: list[Sequence]) -> list[float]:
    """One uniform per row: derived from the seed when there is one, else one shared draw."""
    shared = torch.rand(len(seqs)).tolist() if any(s.params.seed is None for s in seqs) else []
    return [
        shared[i]
        if seq.params.seed is None
        else seeded_uniform(seq.params.seed, seq.choice_index, seq.num_output_tokens)
        for i, seq in enumerate(seqs)
    ]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _scaled(scores: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """Scores divided by each row's temperature (skipping a full pass when all are 1)."""
    return scores if bool((temps == 1.0).all()) else scores / temps


def _sample_plain(scores: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    """Temperature and min_p over the whole vocabulary, then an inverse-CDF draw."""
    temps = _column([p.temperature for p in params], scores.device)
    probs = torch.softmax(_scaled(scores, temps), dim=-1)
    if any(p.min_p > 0.0 for p in params):
        threshold = _column([p.min_p for p in params], scores.device) * probs.amax(-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    cdf = probs.cumsum(dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    overflow = picked >= scores.shape[1]
    if bool(overflow.any()):  # target rounded up to the total: take the last token with weight
        last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
        picked = torch.where(overflow, last, picked)
    return picked.tolist()


def _sample_truncated(
    scores: torch.Tensor, width: int, params: list[SamplingParams], u: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Draw among the `width` best tokens after top_k, top_p and min_p, which all keep a prefix of
    them. Returns the tokens and the rows whose top_p nucleus may extend past the candidates."""
    device = scores.device
    values, ids = scores.topk(width, dim=-1)
    temps = _column([p.temperature for p in params], device)
    # top_p alone measures the nucleus against the whole vocabulary, top_k against the candidates
    partial = [
        k
        for k, p in enumerate(params)
        if p.top_k == 0 and p.top_p < 1.0 and width < scores.shape[1]
    ]
    if len(partial) == len(params):
        probs = torch.softmax(_scaled(scores, temps), dim=-1).gather(1, ids)
    else:
        probs = torch.softmax(_scaled(values, temps), dim=-1)
        if partial:
            rows = _index(partial, device)
            full = torch.softmax(_scaled(scores[rows], temps[rows]), dim=-1)
            probs[rows] = full.gather(1, ids[rows])
    cdf = probs.cumsum(dim=-1)

    top_p = _column([p.top_p for p in params], device)
    keep = ((cdf - probs) < top_p).sum(dim=-1)  # probability mass before the token < top_p
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device)
        keep = torch.minimum(keep, (probs >= min_p * probs[:, :1]).sum(dim=-1))
    kept = keep.tolist()
    uncovered = [k for k in partial if kept[k] == width]
    last = (keep - 1).clamp_(min=0).unsqueeze(1)
    target = u.unsqueeze(1) * cdf.gather(1, last)
    picked = torch.minimum(torch.searchsorted(cdf, target, right=True), last)
    return ids.gather(1, picked).squeeze(1).tolist(), uncovered


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (HF: over prompt + output, positive logits divided, negative multiplied), then
    frequency and presence (OpenAI: over output tokens). Returns `logits` itself when no row has a
    penalty, else a modified fp32 copy. Only the entries of tokens that occurred are touched."""
    if not any(_has_penalty(s.params) for s in seqs):
        return logits
    vocab = logits.shape[1]
    scores = logits.to(torch.float32, copy=True)
    flat = scores.view(-1)
    repeat_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repeat_rows:
        keys, _ = _token_keys(
            [seqs[i].token_ids for i in repeat_rows], repeat_rows, vocab, logits.device
        )
        penalty = _per_row([s.params.repetition_penalty for s in seqs], logits.device)
        penalty = penalty[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    count_rows = [
        i for i, s in enumerate(seqs) if s.params.frequency_penalty or s.params.presence_penalty
    ]
    if count_rows:
        outputs = [seqs[i].output_token_ids for i in count_rows]
        keys, counts = _token_keys(outputs, count_rows, vocab, logits.device)
        rows = keys // vocab
        frequency = _per_row([s.params.frequency_penalty for s in seqs], logits.device)[rows]
        presence = _per_row([s.params.presence_penalty for s in seqs], logits.device)[rows]
        flat[keys] -= frequency * counts + presence
    return scores


def _has_penalty(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _token_keys(
    token_lists: list[list[int]], rows: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row * vocab + token) keys of the tokens in each row's list, with their counts."""
    # quicker to a tensor than torch.tensor(list) (docs/PERFORMANCE.md#step-bookkeeping)
    flat_ids = array("q")
    for ids in token_lists:
        flat_ids.extend(ids)
    tokens = (
        torch.frombuffer(flat_ids, dtype=torch.long)
        if flat_ids
        else torch.empty(0, dtype=torch.long)
    )
    offsets = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.long) * vocab,
        torch.tensor([len(t) for t in token_lists], dtype=torch.long),
    )
    keys, counts = torch.unique(tokens + offsets, return_counts=True)
    return keys.to(device), counts.to(device, torch.float32)


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the `params.logprobs` most likely alternatives, computed on
    the raw model distribution."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[_index(rows, logits.device)].float(), dim=-1)
    chosen = (
        logprobs.gather(1, _index([tokens[i] for i in rows], logits.device).unsqueeze(1))
        .squeeze(1)
        .tolist()
    )
    widest = max(params[i].logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if widest > 0:
        values, ids = logprobs.topk(min(widest, logprobs.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for k, i in enumerate(rows):
        width = params[i].logprobs or 0
        top = list(zip(top_ids[k][:width], top_values[k][:width], strict=True))
        result[i] = TokenLogprob(token_id=tokens[i], logprob=chosen[k], top=top)
    return result
