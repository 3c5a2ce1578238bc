"""Our paged attention inside a transformers model: an attention function registered through
transformers' AttentionInterface and selected by name, so every attention layer calls it with its
own module (layer index, scaling, sliding window); the step's `StepContext` reaches it as a keyword
argument that transformers passes down.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from engine.model.step_context import CONTEXT_KWARG, StepContext

ATTN_IMPLEMENTATION = "modelyard_paged"


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route every attention layer of ``model`` through `_paged_attention_forward`."""
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    for sub in model.modules():  # sub-models (text decoders) carry their own config
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
            sub_config._attn_implementation = ATTN_IMPLEMENTATION


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: [1, H, T, D] in, [1, T, Hq, D] out."""
    ctx = kwargs.get(CONTEXT_KWARG)
    if not isinstance(ctx, StepContext):
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called without {CONTEXT_KWARG}=")
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    # softcap: as the module passes it (Gemma 2 does); transformers' Gemma 3 leaves its config's
    # attn_logit_softcapping unapplied, and so does this
    out = ctx.attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        module.scaling if scaling is None else scaling,
        sliding_window,
        softcap,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention_forward)
