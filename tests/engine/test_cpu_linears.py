"""The CPU fast path's modules on their own: prepacked and fused linears against F.linear
(panel GEMM, oneDNN, bf16), the thread split for big ops, and fused RMS norms."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from engine.model.cpu.kernels import panel_gemm
from engine.model.cpu.linear import (
    FusedProjection,
    PrepackedLinear,
    prepack_linears,
    prepack_supported,
)
from engine.model.cpu.threads import split_threads, threads_for
from engine.model.fast_norms import FusedRMSNorm, fuse_rms_norms


@pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_linear_matches_f_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PrepackedLinear(linear.weight, linear.bias, batch_size_hint=16)
    x = torch.randn(2, rows, 96)
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
@pytest.mark.parametrize("rows", [1, 2, 33, 200])
@pytest.mark.parametrize("split", [False, True])
def test_prepacked_linear_paths_match_f_linear(rows: int, split: bool) -> None:
    """Decode-sized batches take the panel GEMM (without the C kernels: one row the plain-weight
    GEMV), more rows oneDNN's packed GEMM; all under the thread policy (GEMMs on every thread, one
    thread restored after) and without it."""
    torch.manual_seed(0)
    linear = nn.Linear(1536, 1024)
    small = nn.Linear(96, 160)
    x, x_small = torch.randn(rows, 1536), torch.randn(rows, 96)
    with torch.no_grad(), split_threads(2) if split else contextlib.nullcontext():
        for module, inp in ((linear, x), (small, x_small)):
            packed = PrepackedLinear(module.weight, module.bias, batch_size_hint=16)
            torch.testing.assert_close(packed(inp), F.linear(inp, module.weight, module.bias))
            if split:
                assert torch.get_num_threads() == 1  # restored after a parallel GEMM


@pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
def test_prepacked_linear_without_panel_gemm_keeps_a_plain_copy(monkeypatch) -> None:
    """No C kernels (or no AVX-512): single rows run the plain-weight GEMV, as before the panels."""
    monkeypatch.setattr(panel_gemm, "pack", lambda *args: None)
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    packed = PrepackedLinear(linear.weight, linear.bias, batch_size_hint=16)
    assert packed.panel_weight is None and packed.plain_weight is not None
    for rows in (1, 7):
        x = torch.randn(rows, 96)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="no bf16 oneDNN on this CPU"
)
@pytest.mark.parametrize("rows", [1, 33])
def test_bf16_prepacked_linear_matches_fp32_reference(rows: int) -> None:
    """bf16 runs prepacked for every row count (no plain copy); within bf16 rounding of fp32."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 160)
    weight, bias = linear.weight.detach().bfloat16(), linear.bias.detach().bfloat16()
    packed = PrepackedLinear(weight, bias, batch_size_hint=16)
    assert packed.plain_weight is None
    x = torch.randn(rows, 256).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(packed(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_split_threads_grants_threads_to_big_ops_only() -> None:
    previous = torch.get_num_threads()
    assert threads_for(1e12, 1.0) == 0  # outside: leave the count alone
    with split_threads(2):
        assert torch.get_num_threads() == 1
        assert threads_for(5.0, 4.0) == 2
        assert threads_for(3.0, 4.0) == 0
        with split_threads(2):  # nested: no change, the outer section stays in charge
            assert torch.get_num_threads() == 1
        assert threads_for(5.0, 4.0) == 2
    assert torch.get_num_threads() == previous
    assert threads_for(5.0, 4.0) == 0


def test_fused_rms_norms_match_and_skip_other_formulas(tiny_llama_dir: Path) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 60, 7, 300, 42, 9]])
    with torch.no_grad():
        expected = model(ids).logits
        layers = len(model.model.layers)
        assert fuse_rms_norms(model) == 2 * layers + 1
        assert isinstance(model.model.norm, FusedRMSNorm)
        torch.testing.assert_close(model(ids).logits, expected)
        for dtype in (torch.float32, torch.bfloat16):
            gemma = nn.Module()
            gemma.norm = Gemma2RMSNorm(32)  # scales by 1 + weight: not what F.rms_norm does
            gemma.norm.weight.data.normal_()
            gemma.to(dtype)
            assert fuse_rms_norms(gemma) == 0
            assert isinstance(gemma.norm, Gemma2RMSNorm)


def test_prepack_linears_replaces_all_linears_but_keeps_tied_embedding() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 50))
    model[3].weight = model[0].weight  # tied output head
    x = torch.randint(0, 50, (3, 5))
    with torch.no_grad():
        expected = model(x)
        assert prepack_linears(model, batch_size_hint=8) == 2
        assert not any(type(m) is nn.Linear for m in model.modules())
        torch.testing.assert_close(model(x), expected)
    assert model[0].weight.shape == (50, 32)  # the embedding keeps its own matrix


def test_fused_projections_match_separate_ones(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 60, 7, 300, 42, 9]])
    with torch.no_grad():
        expected = model(ids).logits
        prepack_linears(model, batch_size_hint=4)
        attention = model.model.layers[0].self_attn
        assert isinstance(attention.fused_q_k_v, FusedProjection)
        torch.testing.assert_close(model(ids).logits, expected)


def test_fused_member_recomputes_for_a_modified_input() -> None:
    torch.manual_seed(0)
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(8, 4), nn.Linear(8, 6)
    gate_w, up_w = parent.gate_proj.weight.detach().clone(), parent.up_proj.weight.detach().clone()
    gate_b, up_b = parent.gate_proj.bias.detach().clone(), parent.up_proj.bias.detach().clone()
    assert prepack_linears(parent, batch_size_hint=2) == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(parent.gate_proj(x), F.linear(x, gate_w, gate_b))
    x.mul_(2.0)  # same tensor, new contents: the cached result must not be served
    torch.testing.assert_close(parent.up_proj(x), F.linear(x, up_w, up_b))
    torch.testing.assert_close(parent.up_proj(x), F.linear(x, up_w, up_b))  # called twice
