"""The merges engine.model.gguf_merges derives from a vocabulary are generate_merges', in its
order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.tokenization_utils_base import generate_merges

from engine.model.gguf_merges import derived_merges

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
