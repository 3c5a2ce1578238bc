"""The lean Llama-family forward: used where it reproduces transformers, refused where it does not.

Token-level equivalence with transformers' generate() runs through it in
test_engine_correctness (the tiny Llama and SmolLM2 take this path). Here: when it is chosen, and
step-by-step logits against the transformers path of the same runner.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.model.cpu import lean_forward
from engine.model.cpu.kernels import panel_gemm
from engine.model.cpu.kernels.build import available
from engine.model.cpu.lean_forward import LeanLlamaForward
from engine.model.step_profile import QKV_IN_ATTENTION


def make_core(model_dir: Path) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir), num_threads=1, max_model_len=128, max_num_batched_tokens=64
        )
    )


def test_llama_runs_the_lean_forward(tiny_llama_dir: Path) -> None:
    assert make_core(tiny_llama_dir).runner.lean is not None


def test_other_architectures_keep_the_transformers_forward(tiny_sliding_dir: Path) -> None:
    assert make_core(tiny_sliding_dir).runner.lean is None


def test_a_lean_forward_that_differs_is_not_used(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original = LeanLlamaForward.__call__

    def off_by_a_little(self, *args, **kwargs):
        logits = original(self, *args, **kwargs)
        return None if logits is None else logits + 0.01

    monkeypatch.setattr(LeanLlamaForward, "__call__", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="engine.model.runner"):
        core = make_core(tiny_llama_dir)
    assert core.runner.lean is None
    assert "lean forward differs" in caplog.text


def test_lean_logits_match_the_transformers_forward_step_by_step(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed steps (chunked prefills next to decodes, a shared prefix) through both paths; the
    decode-only steps take the fused C call (rotary + cache write + attention) where it builds,
    with the qkv projection inside it where the panel GEMM runs."""
    fused_steps = []

    fused_decode = lean_forward.fused_decode

    def counting_fused_decode(*args, **kwargs):
        fused = fused_decode(*args, **kwargs)
        fused_steps.append(fused is not None)
        return fused

    monkeypatch.setattr(lean_forward, "fused_decode", counting_fused_decode)
    core = make_core(tiny_llama_dir)
    lean = core.runner.lean
    assert lean is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shared = list(range(3, 40))
    prompts = [[*shared, 50, 51], list(range(60, 160)), [*shared, 70], [5, 6, 7]]
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    original_execute = core.runner.execute
    compared = 0
    projected = []  # per lean step, attention calls that also ran their layer's qkv GEMM
    profile = core.profile
    profile.enabled = True

    def execute_both(batch):
        nonlocal compared
        snapshot = [(k.clone(), v.clone()) for k, v in core.runner.kv_caches]
        core.runner.lean = None
        reference = original_execute(batch)
        for (k, v), (k0, v0) in zip(core.runner.kv_caches, snapshot, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        core.runner.lean = lean
        before = profile.calls(QKV_IN_ATTENTION)
        logits = original_execute(batch)
        projected.append(profile.calls(QKV_IN_ATTENTION) - before)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        compared += 1
        return logits

    core.runner.execute = execute_both
    for _ in range(200):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished()
    assert compared >= 12
    assert any(fused_steps) == available()
    panels = panel_gemm.pack(torch.zeros(1, 1)) is not None
    assert (len(lean.layers) in projected) == panels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_is_the_modules_own_values(dtype: torch.dtype) -> None:
    """The per-position table (grown past its first 256 positions on demand) returns exactly what
    transformers' rotary module computes; rotary types that rescale with the length keep the
    module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.model.cpu.lean_forward import _rotary_of, _RotaryTable

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096)
    module = LlamaRotaryEmbedding(config)
    table = _rotary_of(module)
    assert isinstance(table, _RotaryTable)
    x = torch.zeros(1, dtype=dtype)
    for positions in ([0, 5, 17], [3, 255, 256, 1000], [4095, 1, 2]):
        pos = torch.tensor(positions)
        cos, sin = table(x, pos)
        want_cos, want_sin = module(x, pos[None])
        assert cos.dtype == dtype and cos.shape == (len(positions), 32)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert len(table.cos) == 4096
    dynamic = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    assert not isinstance(_rotary_of(LlamaRotaryEmbedding(dynamic)), _RotaryTable)
