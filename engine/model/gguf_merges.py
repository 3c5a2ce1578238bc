"""BPE merges derived from a vocabulary without them (a SentencePiece-style GGUF), in the order
transformers' generate_merges gives them, with numpy instead of a Python loop over every split.

A merge is a split of a piece into two pieces of the vocabulary. transformers ranks them by the
piece's score (best first), then the longer left part, then the longer right part, and keeps the
vocabulary's order among equals. Whether a part is a piece is exact, without hashing: every
distinct prefix of a piece gets an id (its parent prefix's id and its last character, ranked),
and a prefix that is a whole piece is marked; suffixes the same way, on the reversed pieces.
Work and memory grow with the vocabulary's total length (1.5 million characters for Gemma 3).
"""

from __future__ import annotations

import numpy as np

_CODE_POINTS = 0x110000


def derived_merges(pieces: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """The merges of ``pieces`` (distinct, in the vocabulary's order) whose ``scores`` rank
    them, best first."""
    lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
    codes = np.frombuffer("".join(pieces).encode("utf-32-le"), np.uint32).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    owner = np.repeat(np.arange(len(pieces)), lengths)  # the piece of each character
    mirror = (2 * starts + lengths - 1)[owner] - np.arange(len(codes))  # its place reversed
    ends_prefix = _whole_pieces(codes, starts, lengths)
    starts_suffix = _whole_pieces(codes[mirror], starts, lengths)[mirror]
    # a split ends its left part at a character its piece goes on after
    cut = np.flatnonzero(np.diff(owner, append=-1) == 0)
    cut = cut[ends_prefix[cut] & starts_suffix[cut + 1]]
    piece = owner[cut]
    left = cut - starts[piece] + 1
    right = lengths[piece] - left
    order = np.lexsort((piece, -right, -left, -scores[piece]))
    piece, left, right = piece[order], left[order], right[order]
    lefts = _texts(codes, starts[piece], left)
    return list(zip(lefts, _texts(codes, starts[piece] + left, right), strict=True))


def _whole_pieces(codes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """For each character of each piece: whether the piece's prefix ending there is itself a
    piece. Prefix ids are ranks, a length at a time: at length n, those of the pieces at least n
    long, from their (n-1)-prefix's rank and n-th character; the pieces stay sorted by prefix, so
    each sort finds runs already in order."""
    ids = np.zeros(len(codes), np.int64)
    active = np.arange(len(starts))
    rank = np.zeros(len(starts), np.int64)  # of each active piece's prefix
    offset = 0
    for n in range(1, int(lengths.max(initial=0)) + 1):
        keep = lengths[active] >= n
        active, rank = active[keep], rank[keep]
        at = starts[active] + n - 1
        keys = rank * _CODE_POINTS + codes[at]
        order = np.argsort(keys, kind="stable")
        active, at, keys = active[order], at[order], keys[order]
        rank = np.cumsum(np.diff(keys, prepend=keys[:1]) != 0)
        ids[at] = rank + offset
        offset += int(rank[-1]) + 1
    ends_here = (starts + lengths - 1)[lengths > 0]  # a piece's last character
    is_piece = np.zeros(offset, bool)
    is_piece[ids[ends_here]] = True
    return is_piece[ids]


def _texts(codes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The strings codes[start:start + length], decoded at once: joined by a code point no
    piece holds, then split on it."""
    present = np.zeros(_CODE_POINTS, bool)
    present[codes] = True
    present[0xD800:0xE000] = True  # surrogates: not characters
    if present.all():
        raise ValueError("a vocabulary that holds every character")
    separator = int(np.argmin(present))
    bounds = np.cumsum(lengths + 1)
    joined = np.full(int(bounds[-1]) if len(bounds) else 0, separator, np.uint32)
    inside = np.ones(len(joined), bool)
    inside[bounds - 1] = False
    joined[inside] = codes[
        np.flatnonzero(inside) + np.repeat(starts - bounds + lengths + 1, lengths)
    ]
    return joined.tobytes().decode("utf-32-le").split(chr(separator))[:-1]
