"""What the sampler (engine.core.sampling) runs from model/, so that core reaches the CPU kernels
and thread helpers through one module: the greedy pick, on the C argmax kernel where it serves
the logits, and a single-threaded scope for small ops."""

from __future__ import annotations

import contextlib

import torch

from engine.model.cpu.kernels.argmax import argmax_rows
from engine.model.cpu.threads import split_threads


def greedy_tokens(scores: torch.Tensor) -> list[int]:
    """Each row's most likely token (the first of equals): the C kernel where it serves these
    scores, else torch's max."""
    tokens = argmax_rows(scores)
    return tokens if tokens is not None else scores.max(dim=-1).indices.tolist()


def single_threaded() -> contextlib.AbstractContextManager[None]:
    """The body on one thread: engine.model.cpu.threads.split_threads, under which only ops that
    ask for torch's full count get it (none of the sampler's do)."""
    return split_threads(torch.get_num_threads())
