"""Sampler: greedy, truncation filters, temperature, penalties, seeds and logprobs, each checked
against a straightforward reference written here."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.core.sampling import Sampler, apply_penalties
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError

torch.set_num_threads(1)
_ids = itertools.count()


def make_seq(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    choice_index: int = 0,
    **params: object,
) -> Sequence:
    seq = Sequence(next(_ids), "req", prompt or [1, 2, 3], SamplingParams(**params), choice_index)
    for token in output or []:
        seq.append_token(token)
    return seq


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_distribution(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Target distribution of one row, by the textbook recipe: sort, cut, renormalise."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    kept = torch.where(keep, sorted_probs, 0.0)
    kept = kept / kept.sum()
    before = kept.cumsum(0) - kept
    keep &= before < top_p
    keep &= sorted_probs >= min_p * sorted_probs[0]
    result = torch.zeros_like(probs)
    result[order[keep]] = sorted_probs[keep]
    return result / result.sum()


def chi_square(samples: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0, "sampled a token outside the allowed set"
    mask = expected > 0
    want = expected[mask] * len(samples)
    return float(((counts[mask] - want) ** 2 / want).sum())


def draw_many(logits_row: torch.Tensor, draws: int, sampler: Sampler | None = None, **params):
    """One batch of `draws` rows sharing the logits, each its own seed."""
    seqs = [make_seq(seed=i, **params) for i in range(draws)]
    tokens, _ = (sampler or Sampler())(logits_row.expand(draws, -1).contiguous(), seqs)
    return tokens


def test_greedy_equals_argmax_alone_and_in_mixed_batch() -> None:
    logits = random_logits(6, 1000, seed=0)
    tokens, logprobs = Sampler()(logits, [make_seq(temperature=0.0) for _ in range(6)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 6

    mixed = [make_seq(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    tokens, _ = Sampler()(logits, mixed)
    assert tokens[1::2] == logits[1::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [50, 1000])
def test_top_k_one_and_tiny_top_p_equal_greedy(vocab: int) -> None:
    logits = random_logits(8, vocab, seed=1)
    argmax = logits.argmax(dim=-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 5, "top_p": 1e-6}):
        seqs = [make_seq(temperature=1.5, seed=i, **params) for i in range(8)]
        assert Sampler()(logits, seqs)[0] == argmax, params


def test_min_p_keeps_exactly_the_tokens_above_the_threshold() -> None:
    logits = torch.tensor([2.0, 1.9, 1.0, 0.5, 1.5, -1.0, 1.8, 0.0])
    probs = torch.softmax(logits, dim=-1)
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < len(logits)
    tokens = draw_many(logits, 2000, min_p=0.5)
    assert set(tokens) == allowed


@pytest.mark.parametrize(
    ("temperature", "filters"),
    [
        (1.0, {}),
        (0.5, {}),
        (1.7, {}),
        (1.0, {"top_k": 4}),
        (0.8, {"top_p": 0.8}),
        (1.2, {"min_p": 0.1}),
        (1.0, {"top_k": 6, "top_p": 0.9, "min_p": 0.05}),
        (1.0, {"top_k": 6, "min_p": 0.3}),
    ],
)
def test_seeded_draws_follow_the_reference_distribution(temperature: float, filters) -> None:
    logits = torch.tensor([1.0, 0.3, -0.5, 2.0, 0.0, 1.4, -1.2, 0.8])
    expected = reference_distribution(logits, temperature, **filters)
    tokens = draw_many(logits, 10_000, temperature=temperature, **filters)
    # 7 degrees of freedom at most: P(chi2 > 30) < 1e-4; the draws are seeded, so no flakiness.
    assert chi_square(tokens, expected) < 30.0


def test_unseeded_draws_follow_the_distribution() -> None:
    logits = torch.tensor([0.5, 1.5, -0.5, 1.0, 0.0])
    torch.manual_seed(0)
    seqs = [make_seq(temperature=0.9) for _ in range(10_000)]
    tokens, _ = Sampler()(logits.expand(len(seqs), -1).contiguous(), seqs)
    assert chi_square(tokens, reference_distribution(logits, 0.9)) < 30.0


@pytest.mark.parametrize("scale", [0.2, 6.0])  # flat: nucleus beyond the candidates; peaked: within
def test_top_p_candidate_search_matches_the_full_sort(scale: float) -> None:
    logits = random_logits(1, 60, seed=3, scale=scale)[0]
    expected = reference_distribution(logits, 1.0, top_p=0.7)
    tokens = draw_many(logits, 10_000, sampler=Sampler(top_p_candidates=8), top_p=0.7)
    dof = int((expected > 0).sum()) - 1
    assert chi_square(tokens, expected) < dof + 6 * dof**0.5 + 10


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0], [2.0, -1.0, 0.5, 0.0, 3.0, -2.0]])
    penalised = make_seq(
        prompt=[0, 1],
        output=[2, 2, 4],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        temperature=0.0,
    )
    untouched = make_seq(prompt=[0, 1], output=[2, 2, 4], temperature=0.0)
    # repetition over prompt+output {0,1,2,4}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, 3 -> 1.5;
    # then token 2 (twice): 0.25 - 2*0.5 - 0.25 = -1.0; token 4 (once): 1.5 - 0.5 - 0.25 = 0.75
    expected = torch.tensor([1.0, -2.0, -1.0, 0.0, 0.75, -2.0])
    scores = apply_penalties(logits, [penalised, untouched])
    torch.testing.assert_close(scores[0], expected)
    torch.testing.assert_close(scores[1], logits[1])
    assert logits[0, 4] == 3.0  # the input is not modified
    assert Sampler()(logits, [penalised, untouched])[0] == [0, 4]


def test_presence_and_frequency_only_count_output_tokens() -> None:
    logits = torch.zeros(1, 5)
    seq = make_seq(prompt=[3, 3, 3], output=[1], presence_penalty=1.0, frequency_penalty=1.0)
    torch.testing.assert_close(
        apply_penalties(logits, [seq])[0], torch.tensor([0.0, -2.0, 0.0, 0.0, 0.0])
    )


def test_no_penalty_returns_the_logits_unchanged() -> None:
    logits = random_logits(2, 10, seed=4)
    assert apply_penalties(logits, [make_seq(), make_seq()]) is logits


CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 0.9, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 40, "top_p": 0.8, "min_p": 0.01},
    {"temperature": 1.0, "repetition_penalty": 1.3, "presence_penalty": 0.5},
]


def generate(
    sampler: Sampler, target: Sequence, others: list[Sequence], row: int, steps: int
) -> list[int]:
    """Run `steps` sampling steps on random logits (a fixed stream per step). The target sits at
    `row` among `others`, which keep growing too."""
    out = []
    for step in range(steps):
        batch = [*others[:row], target, *others[row:]]
        logits = random_logits(len(batch), 2000, seed=1000 + step, scale=2.0)
        target_logits = random_logits(1, 2000, seed=step, scale=2.0)
        logits[row] = target_logits[0]
        tokens, _ = sampler(logits, batch)
        for seq, token in zip(batch, tokens, strict=True):
            seq.append_token(token)
        out.append(tokens[row])
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_seeded_tokens_do_not_depend_on_the_batch(config: dict) -> None:
    sampler = Sampler(top_p_candidates=64)
    torch.manual_seed(1)
    alone = generate(sampler, make_seq(seed=1234, **config), [], 0, steps=12)

    torch.manual_seed(2)  # a different global RNG state must not matter either
    others = [
        make_seq(output=[5] * 7, seed=99, **config),
        make_seq(temperature=0.0),
        make_seq(output=[1, 2], temperature=1.0),  # unseeded
        make_seq(seed=1234, choice_index=1, **config),
        make_seq(output=[9] * 3, temperature=0.5, top_k=3),
        make_seq(seed=5, top_k=64),  # shares the top_p rows' candidate width: a mixed group
    ]
    batched = generate(sampler, make_seq(seed=1234, **config), others, 3, steps=12)
    assert batched == alone

    again = generate(sampler, make_seq(seed=1234, **config), [], 0, steps=12)
    assert again == alone
    other_seed = generate(sampler, make_seq(seed=4321, **config), [], 0, steps=12)
    assert other_seed != alone
    other_choice = generate(sampler, make_seq(seed=1234, choice_index=1, **config), [], 0, 12)
    assert other_choice != alone


def test_logprobs_match_log_softmax_of_the_raw_logits() -> None:
    logits = random_logits(4, 300, seed=5)
    seqs = [
        make_seq(temperature=0.0, logprobs=5),
        make_seq(temperature=1.0, seed=1, logprobs=0),
        make_seq(temperature=0.0),
        make_seq(temperature=0.7, seed=2, logprobs=20, repetition_penalty=1.5, output=[7, 8]),
    ]
    tokens, logprobs = Sampler()(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[2] is None
    for row, k in ((0, 5), (1, 0), (3, 20)):
        entry = logprobs[row]
        assert entry is not None
        assert entry.token_id == tokens[row]
        assert entry.logprob == pytest.approx(float(reference[row, tokens[row]]), abs=1e-5)
        values, ids = reference[row].topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(entry.top))
    assert logprobs[0].top[0][0] == tokens[0]  # greedy picks the most likely token


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("n", 0),
        ("max_tokens", 0),
        ("stop", [""]),
    ],
)
def test_invalid_params_raise_invalid_request(param: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param
    assert info.value.status == 400


def test_bf16_logits_sample_as_their_fp32_widening() -> None:
    """Logits arrive in the model's dtype: a bf16 batch (greedy, seeded draws with filters,
    penalties, logprobs) picks the same tokens with the same logprobs as the same values in fp32,
    all-greedy batches included (a max over bf16 picks what it picks over fp32)."""
    logits = random_logits(6, 300, seed=8).to(torch.bfloat16)
    logits[0, 17] = logits[0, 42] = logits[0].max()  # a tie: the first index wins either way

    def batch() -> list[Sequence]:
        return [
            make_seq(temperature=0.0, logprobs=3),
            make_seq(temperature=0.8, seed=3, top_k=20),
            make_seq(temperature=1.0, seed=4, top_p=0.9, min_p=0.05),
            make_seq(temperature=0.0, repetition_penalty=1.3, output=[5, 9]),
            make_seq(temperature=1.2, seed=5, frequency_penalty=0.5, output=[1, 1], logprobs=2),
            make_seq(temperature=0.0),
        ]

    narrow, wide = Sampler()(logits, batch()), Sampler()(logits.float(), batch())
    assert narrow == wide and narrow[0][0] == 17
    greedy_only = [make_seq(temperature=0.0) for _ in range(6)]
    assert Sampler()(logits, greedy_only)[0] == Sampler()(logits.float(), greedy_only)[0]
