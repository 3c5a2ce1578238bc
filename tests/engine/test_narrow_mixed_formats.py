"""Projections of mixed narrow formats fuse: every format converts into int8k exactly, so a
Q4_K_M file's Q4_K q/k beside its Q6_K v still make one q/k/v GEMM (the one-call decode step runs
fused projections only), with the outputs of the separate linears; int8h, int4k, int5k and int5h,
which spell int8's, int4's and int5's values with narrower scales, fuse with those in them; int2k
(Q2_K: a min per half-block, which int8k cannot hold) and every other format into int8km."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.quant_formats import (
    FORMATS,
    QuantizedWeight,
    as_format,
    concatenate,
    from_gguf_blocks,
    quantize,
)
from engine.model.cpu.quant_linear import QuantizedLinear
from engine.model.cpu.quantize import quantize_model
from tests.engine.test_cpu_quant_gemm import BUILDS, reference, run
from tests.engine.test_gguf_weights import K, _random_blocks

HIDDEN, WIDTH = 64, 96


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_converts_into_int8k_or_int8km_exactly(fmt):
    """Into int8km every one (44 and 48 bytes a block); into int8k all but int2k and int8km."""
    weight = quantize(torch.randn(9, 96, generator=torch.Generator().manual_seed(2)), fmt)
    for wide, block_bytes in (("int8k", 44), ("int8km", 48)):
        if wide == "int8k" and fmt in ("int2k", "int8km"):
            with pytest.raises(ValueError, match="do not convert"):
                as_format(weight, wide)
            continue
        promoted = as_format(weight, wide)
        assert promoted.fmt == wide and promoted.records.shape[1] == 96 // 32 * block_bytes
        assert torch.equal(promoted.dequantize(), weight.dequantize())


@pytest.mark.parametrize(
    "block_type", ["Q8_0", "IQ4_NL", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q2_K"]
)
def test_gguf_blocks_convert_into_int8k_exactly(block_type):
    """Every stored scale, offset and integer as the file gives it (Q4_0: m = -8 d); Q2_K's into
    int8km."""
    weight = from_gguf_blocks(block_type, _random_blocks(block_type, np.random.default_rng(5)), K)
    wide = "int8km" if block_type == "Q2_K" else "int8k"
    assert torch.equal(as_format(weight, wide).dequantize(), weight.dequantize())


def test_int5h_converts_into_int8h_and_int8_exactly():
    """int5h's integers less 16 as int8s, under its own fp16 scales (int8h) or those in fp32."""
    weight = quantize(torch.randn(9, 608, generator=torch.Generator().manual_seed(6)), "int5h")
    for fmt in ("int8h", "int8"):
        converted = as_format(weight, fmt)
        assert converted.fmt == fmt and torch.equal(converted.dequantize(), weight.dequantize())


@pytest.mark.parametrize("second", FORMATS)
@pytest.mark.parametrize("first", FORMATS)
def test_every_pairing_concatenates_exactly(first, second):
    """Any two formats fuse, each part's values as they were (19 blocks: int2k's, int4k's and
    int5k's last super-block 3), in a format no wider than int8k's 44 bytes a block (int8km's 48
    where a part is int2k or int8km)."""
    generator = torch.Generator().manual_seed(8)
    parts = [quantize(torch.randn(3, 608, generator=generator), fmt) for fmt in (first, second)]
    fused = concatenate(parts)
    assert torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in parts]))
    half_offsets = {first, second} & {"int2k", "int8km"}
    assert fused.records.shape[1] <= 608 // 32 * (48 if half_offsets else 44)


def test_int8k_converts_into_nothing_else():
    with pytest.raises(ValueError, match="do not convert"):
        as_format(quantize(torch.randn(2, 32), "int8k"), "int8")


@pytest.mark.parametrize(
    ("narrow", "wide"),
    [("int8h", "int8"), ("int4k", "int4"), ("int5k", "int5"), ("int5h", "int5")],
)
def test_narrower_scales_widen_into_their_format_only(narrow, wide):
    """int8h into int8, int4k into int4, int5k and int5h into int5, exactly (19 blocks: the last
    super-block of int4k and int5k 3 blocks); nothing narrows, nor widens elsewhere."""
    weight = quantize(torch.randn(9, 608, generator=torch.Generator().manual_seed(4)), narrow)
    widened = as_format(weight, wide)
    assert widened.fmt == wide and torch.equal(widened.dequantize(), weight.dequantize())
    for fmt, source in ((narrow, quantize(torch.randn(2, 32), wide)), ("int6", weight)):
        with pytest.raises(ValueError, match="do not convert"):
            as_format(source, fmt)


def test_concatenate_promotes_only_mixed_formats():
    parts = [quantize(torch.randn(n, 64), "int4") for n in (8, 3)]
    same = concatenate(parts)
    assert same.fmt == "int4" and torch.equal(same.records, torch.cat([p.records for p in parts]))
    mixed = concatenate([*parts, quantize(torch.randn(5, 64), "int8")])
    assert mixed.fmt == "int8k" and mixed.out_features == 16
    # int8h beside int8 (a Q8_0 v beside q/k quantised in int8 mode): in int8, not int8k
    int8s = [quantize(torch.randn(4, 64), fmt) for fmt in ("int8", "int8h", "int8")]
    widened = concatenate(int8s)
    assert widened.fmt == "int8"
    assert torch.equal(widened.dequantize(), torch.cat([w.dequantize() for w in int8s]))
    # int5k beside int5 (a Q5_K_M file's Q5_K q/k beside a Q5_0 v) in int5; beside int4k in int8k
    int5s = [quantize(torch.randn(4, 64), fmt) for fmt in ("int5k", "int5", "int5k")]
    widened = concatenate(int5s)
    assert widened.fmt == "int5"
    assert torch.equal(widened.dequantize(), torch.cat([w.dequantize() for w in int5s]))
    assert concatenate([int5s[0], quantize(torch.randn(4, 64), "int4k")]).fmt == "int8k"
    # int5h (Q5_0) fuses as it is with int5h, in int5 beside int5k or int5, in int8k beside int6
    int5h = quantize(torch.randn(4, 64), "int5h")
    assert concatenate([int5h, int5h]).fmt == "int5h"
    widened = concatenate([int5h, *int5s])
    assert widened.fmt == "int5"
    assert torch.equal(
        widened.dequantize(), torch.cat([int5h.dequantize(), *[w.dequantize() for w in int5s]])
    )
    assert concatenate([int5h, quantize(torch.randn(4, 64), "int6")]).fmt == "int8k"
    # int5h beside int8h (Gemma 3 Q4_K_M's Q5_0 q/k beside a Q8_0 v) in int8h, beside int8 in int8
    for fmt in ("int8h", "int8"):
        mixed = [int5h, quantize(torch.randn(4, 64), fmt)]
        widened = concatenate(mixed)
        assert widened.fmt == fmt
        assert torch.equal(widened.dequantize(), torch.cat([w.dequantize() for w in mixed]))
    # int2k (Q2_K q/k/gate/up) fuses as it is with int2k; beside int8k (a Q3_K v) or int4k (Q4_K)
    # in int8km, as int8k beside int4k stays in int8k
    int2k = quantize(torch.randn(4, 64), "int2k")
    assert concatenate([int2k, int2k]).fmt == "int2k"
    for fmt in ("int8k", "int4k"):
        assert concatenate([int2k, quantize(torch.randn(4, 64), fmt)]).fmt == "int8km"
    assert concatenate([quantize(torch.randn(4, 64), f) for f in ("int4k", "int8k")]).fmt == "int8k"
    with pytest.raises(ValueError, match="input width"):
        concatenate([parts[0], quantize(torch.randn(2, 32), "int4")])


@pytest.mark.skipif(not BUILDS, reason="no C compiler here")
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("beside", ["Q3_K", "Q4_K"])
def test_q2_k_fuses_exactly_beside_q3_k_and_q4_k(isa, beside):
    """A Q2_K file's q/k beside its Q3_K or Q4_K v: the GEMM of the parts fused in int8km against
    the float64 reference of the file's values, the Q2_K part's columns its own int2k GEMM's bit
    for bit (int2k's kernel takes int8km's steps)."""
    rng = np.random.default_rng(7)
    parts = [from_gguf_blocks(t, _random_blocks(t, rng), K) for t in ("Q2_K", beside, "Q2_K")]
    fused = concatenate(parts)
    assert fused.fmt == "int8km"
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7)) * 4
    out = run(isa, fused, x, None)
    torch.testing.assert_close(out, reference(x, fused, None), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, : parts[0].out_features], run(isa, parts[0], x, None))


def _tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=WIDTH,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.skipif(not BUILDS, reason="no C compiler here")
@pytest.mark.parametrize(
    "formats, fused_formats",
    [
        ({"q_proj": "int4", "k_proj": "int8", "v_proj": "int8k"}, ("int8k", "int4")),
        ({"q_proj": "int4", "k_proj": "int4", "v_proj": "int8", "up_proj": "int8"}, ("int8k",) * 2),
        ({"q_proj": "int8", "k_proj": "int8", "v_proj": "int8h"}, ("int8", "int4")),
        (
            {"q_proj": "int5k", "k_proj": "int5k", "v_proj": "int5", "gate_proj": "int5k"},
            ("int5", "int8k"),
        ),
        # Gemma 3's Q4_K_M: Q5_0 q/k/gate/up, a Q5_0 v in most layers and a Q6_K or Q8_0 one in some
        (
            dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), "int5h"),
            ("int5h", "int5h"),
        ),
        ({"q_proj": "int5h", "k_proj": "int5h", "v_proj": "int8h"}, ("int8h", "int4")),
        ({"q_proj": "int5h", "k_proj": "int5h", "v_proj": "int6"}, ("int8k", "int4")),
        # a Q2_K file: Q2_K q/k/gate/up, a Q3_K v
        (
            {
                **dict.fromkeys(("q_proj", "k_proj", "gate_proj", "up_proj"), "int2k"),
                "v_proj": "int8k",
            },
            ("int8km", "int2k"),
        ),
        ({}, ("int4", "int4")),  # one format: fused as it is
    ],
)
def test_mixed_parts_fuse_with_the_outputs_of_the_separate_linears(formats, fused_formats):
    """The file's blocks (``native``) in the given formats (the rest int4); the fused GEMM's
    slices equal each part's own linear, in its own format."""
    model = _tiny_llama()
    parts: dict[str, QuantizedWeight] = {}

    def native(hf_names: list[str]) -> QuantizedWeight | None:
        name = hf_names[0]
        projection = name.split(".")[-2]
        if not name.startswith("model.layers.") or projection in ("o_proj", "down_proj"):
            return None
        weight = model.get_parameter(name).detach()
        parts[projection] = quantize(weight, formats.get(projection, "int4"))
        return parts[projection]

    lib = quant_gemm.library()
    report = quantize_model(model, "gguf", native, lib)
    assert report.native == 5
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert (attention.fused_q_k_v.gemm.fmt, mlp.fused_gate_up.gemm.fmt) == fused_formats
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for module, names in (
        (attention, ("q_proj", "k_proj", "v_proj")),
        (mlp, ("gate_proj", "up_proj")),
    ):
        for name in names:
            separate = QuantizedLinear(parts[name], None, lib)(h)
            torch.testing.assert_close(getattr(module, name)(h), separate, rtol=1e-5, atol=1e-5)
