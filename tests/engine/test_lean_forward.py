"""The lean forward: used where it reproduces transformers, refused (the reason logged) where it
does not.

For every architecture it runs, on a tiny random model of it: the runner picks it; step by step
over mixed steps (chunked prefills next to decodes, a shared prefix, prompts past the sliding
windows) its logits match the transformers path of the same runner, on dense and on narrow
weights; its greedy output equals transformers' generate() on the model folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams
from engine.model.cpu import lean_forward
from engine.model.cpu.kernels import panel_gemm, quant_gemm
from engine.model.cpu.kernels.build import available
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder
from engine.model.cpu.lean_forward import LeanLlamaForward
from engine.model.cpu.quant_linear import QuantizedLinear
from engine.model.runner import _LEAN_TOLERANCE, _NARROW_LEAN_TOLERANCE
from engine.model.step_batch import StepBatch
from engine.model.step_profile import QKV_IN_ATTENTION
from scripts.tiny_models import (
    build_tiny_gemma3,
    build_tiny_llama,
    build_tiny_mistral,
    build_tiny_phi3,
    build_tiny_qwen2,
    build_tiny_qwen3,
)
from tests.engine.test_engine_correctness import (
    engine_tokens,
    greedy,
    random_prompts,
    reference_greedy,
)

# Every architecture the lean forward runs, as a tiny random model (scripts/tiny_models.py).
ARCHITECTURES: dict[str, Callable[[Path], Path]] = {
    "llama": build_tiny_llama,
    "qwen2": build_tiny_qwen2,  # q/k/v biases
    "qwen3": build_tiny_qwen3,  # q/k norms
    "mistral": build_tiny_mistral,  # a sliding window on every layer, from the config
    "phi3": build_tiny_phi3,  # its own fused linears, a sliding window from the config
    "gemma3": build_tiny_gemma3,  # sliding and global layers, (1 + w) norms, GeGLU, ...
    # a final cap of about the largest logit: a missing cap moves the logits by ~20%
    "gemma3-softcap": partial(build_tiny_gemma3, final_logit_softcapping=4.0),
}
UNSUPPORTED = {  # variants it refuses, and the reason it logs
    "phi3-partial-rotary": (
        partial(build_tiny_phi3, partial_rotary_factor=0.5),
        "rotary embedding covers part of each head only",
    ),
}
FP32_TOLERANCE = _LEAN_TOLERANCE[torch.float32]
needs_narrow_kernels = pytest.mark.skipif(quant_gemm.library() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny model of an architecture (or unsupported variant) by name, built once."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            builder = ARCHITECTURES.get(name) or UNSUPPORTED[name][0]
            built[name] = builder(tmp_path_factory.mktemp(name))
        return built[name]

    return get


def make_core(model_dir: Path, **config: object) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            num_threads=1,
            max_model_len=128,
            max_num_batched_tokens=64,
            kv_cache_memory=8 * 2**20,  # the step-by-step tests copy the pools every step
            **config,
        )
    )


@dataclass
class Compared:
    """Logits of the lean forward against the transformers path, step by step."""

    steps: int = 0
    worst: float = 0.0  # largest |logit difference| over every step
    scale: float = 0.0  # largest |logit| of the transformers path
    fused: list[bool] = field(default_factory=list)  # per fused_decode call: whether it served
    projected: list[int] = field(default_factory=list)  # per step: attention calls that ran qkv

    def within(self, tolerance: float) -> bool:
        """As the runner's load probe judges it."""
        return self.worst <= tolerance * max(1.0, self.scale)


def compare_step_by_step(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> Compared:
    """Run mixed steps through both paths of ``core``'s runner, each from the same KV cache; the
    lean path's cache carries on. The decode-only steps take the fused C call (rotary + cache
    write + attention) where it builds, with the qkv projection inside it where the panel GEMM
    runs and no q/k norm comes between."""
    compared = Compared()
    fused_decode = lean_forward.fused_decode

    def counting_fused_decode(*args, **kwargs):
        fused = fused_decode(*args, **kwargs)
        compared.fused.append(fused is not None)
        return fused

    monkeypatch.setattr(lean_forward, "fused_decode", counting_fused_decode)
    runner = core.runner
    lean = runner.lean
    assert lean is not None
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    shared = list(range(3, 40))
    prompts = [[*shared, 50, 51], list(range(60, 160)), [*shared, 70], [5, 6, 7]]
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    execute = runner.execute
    profile = core.profile
    profile.enabled = True

    def execute_both(batch: StepBatch) -> torch.Tensor:
        snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        runner.lean = None
        reference = execute(batch)
        for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        runner.lean = lean
        before = profile.calls(QKV_IN_ATTENTION)
        logits = execute(batch)
        compared.projected.append(profile.calls(QKV_IN_ATTENTION) - before)
        if len(reference):
            difference = (logits.float() - reference.float()).abs().max().item()
            compared.worst = max(compared.worst, difference)
            compared.scale = max(compared.scale, reference.float().abs().max().item())
        compared.steps += 1
        return logits

    monkeypatch.setattr(runner, "execute", execute_both)
    for _ in range(200):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished()
    return compared


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_runner_runs_the_lean_forward(
    arch: str, model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.model.runner"):
        core = make_core(model_dir(arch))
    assert core.runner.lean is not None
    assert "lean forward in use" in caplog.text


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lean_logits_match_the_transformers_forward_step_by_step(
    arch: str, model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(model_dir(arch))
    lean = core.runner.lean
    compared = compare_step_by_step(core, monkeypatch)
    assert compared.steps >= 12
    assert compared.within(FP32_TOLERANCE), (compared.worst, compared.scale)
    assert any(compared.fused) == available()
    # the fused call runs the qkv GEMM of every layer without q/k norms, on the panel GEMM
    panels = panel_gemm.pack(torch.zeros(1, 1)) is not None
    plain_qkv = sum(layer.qk_norm is None for layer in lean.layers)
    assert max(compared.projected) == (plain_qkv if panels else 0)


@needs_narrow_kernels
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lean_logits_match_on_narrow_weights(
    arch: str, model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every linear in int8 (int4 moves the top token of some tiny random models too far for the
    load's quantisation probe), the same ones in both paths: the logits agree within the runner's
    tolerance for narrow weights (their GEMMs round activations to int8). Decode steps run every
    layer in one call (NarrowDecoder), q/k norms, sandwich norms, GeGLU, two rotary tables and
    Phi-3's own [gate; up] (packed paired) included."""
    core = make_core(model_dir(arch), quantization="int8")
    lean = core.runner.lean
    assert lean is not None
    assert all(isinstance(m, QuantizedLinear) for layer in lean.layers for m in layer.linears())
    assert isinstance(lean.lm_head, QuantizedLinear)
    one_call = available()
    assert (lean.narrow is not None) == one_call
    calls = 0
    decode = NarrowDecoder.__call__

    def counted_decode(*args, **kwargs):
        nonlocal calls
        calls += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(NarrowDecoder, "__call__", counted_decode)
    compared = compare_step_by_step(core, monkeypatch)
    assert compared.within(_NARROW_LEAN_TOLERANCE), (compared.worst, compared.scale)
    assert (calls > 0) == one_call


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_generate(arch: str, model_dir: Callable[[str], Path]) -> None:
    """Against transformers' own model and generate(): an independent reference."""
    folder = model_dir(arch)
    prompts = random_prompts([40, 9], seed=3)  # 40: past every sliding window from the prompt on
    llm = LLM(str(folder), num_threads=1, max_model_len=128, kv_cache_memory=8 * 2**20)
    assert llm.engine.runner.lean is not None
    assert engine_tokens(llm, prompts, greedy(10)) == reference_greedy(folder, prompts, 10)


@pytest.mark.parametrize("variant", UNSUPPORTED)
def test_unsupported_variants_log_why_and_keep_the_transformers_forward(
    variant: str, model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.model.cpu.lean_forward"):
        core = make_core(model_dir(variant))
    assert core.runner.lean is None
    assert f"lean forward not built for {type(core.runner.model).__name__}: " in caplog.text
    assert UNSUPPORTED[variant][1] in caplog.text


def test_other_architectures_log_why_and_keep_the_transformers_forward(
    tiny_sliding_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.model.cpu.lean_forward"):
        core = make_core(tiny_sliding_dir)
    assert core.runner.lean is None
    assert "architecture 'gemma2' is not one the lean forward runs" in caplog.text


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
