"""A GGUF's weights come from the file as it holds them: each block type a narrow format holds
(Q8_0, IQ4_NL -> int8h; IQ4_XS -> int8; Q4_0, Q4_1 -> int4; Q4_K -> int4k; Q5_0 -> int5h;
Q5_1 -> int5; Q5_K -> int5k; Q6_K -> int6; Q2_K -> int2k; Q3_K -> int8k) reproduces gguf's own
dequantisation bit for bit, and a whole model loaded from the file equals the one transformers
builds by dequantising every tensor (its weights on narrow records where the file's blocks allow,
in the same row order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from gguf import quantize as gguf_quantize
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.model.cpu.fast_path import prepare_cpu_fast_path
from engine.model.cpu.gguf_file import GgufFile
from engine.model.cpu.quant_formats import GGUF_BLOCKS, from_gguf_blocks
from engine.model.cpu.quant_linear import QuantizedEmbedding
from engine.model.loader import load_model
from tests.conftest import GEMMA_GGUF, SMOLLM2_GGUF

ROWS, K = 24, 512
# Where the fp16 scales of the K-quants' super-blocks and the IQ4s' blocks lie (bytes [start,
# end)): every other bit pattern of theirs is valid (integer scales, mins, quants and indices).
FP16_SCALES = {
    "Q2_K": (80, 84),
    "Q4_K": (0, 4),
    "Q5_K": (0, 4),
    "Q3_K": (108, 110),
    "Q6_K": (208, 210),
    "IQ4_NL": (0, 2),
    "IQ4_XS": (0, 2),
}


def _random_blocks(block_type: str, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, bytes] of valid blocks: gguf's quantiser where it has one, else (the K-quants, the
    IQ4s) random bytes with finite fp16 scales (Q2_K, Q4_K, Q5_K: d and dmin; the others d)."""
    qtype = GGMLQuantizationType[block_type]
    if block_type not in FP16_SCALES:
        return gguf_quantize(rng.standard_normal((ROWS, K)).astype(np.float32), qtype)
    _, elements, size = GGUF_BLOCKS[block_type]
    start, end = FP16_SCALES[block_type]
    blocks = rng.integers(0, 256, (ROWS, K // elements, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, (ROWS, K // elements, (end - start) // 2)).astype(np.float16)
    blocks[..., start:end] = scales.view(np.uint8).reshape(ROWS, K // elements, end - start)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("block_type", sorted(GGUF_BLOCKS))
def test_each_block_type_loads_bit_exact(block_type):
    raw = _random_blocks(block_type, np.random.default_rng(len(block_type)))
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[block_type]).copy())
    weight = from_gguf_blocks(block_type, raw, K)
    assert weight.fmt == GGUF_BLOCKS[block_type][0]
    assert torch.equal(weight.dequantize(), reference)
    index = torch.tensor([5, 0, 23])
    assert torch.equal(weight.dequantize(index), reference[index])


@pytest.mark.parametrize(
    ("block_type", "fmt", "block_bytes"),
    [("Q8_0", "int8h", 34), ("IQ4_NL", "int8h", 34), ("Q5_0", "int5h", 22)],
)
def test_fp16_scales_load_as_the_file_holds_them(block_type, fmt, block_bytes):
    """Q8_0's and IQ4_NL's scales go into int8h, Q5_0's into int5h, as the file's fp16s (Q8_0's
    and Q5_0's records the file's 34 and 22 bytes a block): every finite fp16 as a block's scale,
    subnormals and the largest included, dequantises bit for bit as gguf does (Q5_0's q of 0 and
    31 among the random bytes' integers)."""
    _, elements, size = GGUF_BLOCKS[block_type]
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    scales = patterns[np.isfinite(patterns.view(np.float16))].reshape(-1, 16)  # 16 blocks a row
    rows = scales.shape[0]
    blocks = np.random.default_rng(3).integers(0, 256, (rows, 16, size), dtype=np.uint8)
    blocks[..., :2] = scales.view(np.uint8).reshape(rows, 16, 2)
    raw = blocks.reshape(rows, -1)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[block_type]).copy())
    weight = from_gguf_blocks(block_type, raw, 16 * elements)
    assert weight.fmt == fmt and weight.nbytes == rows * 16 * block_bytes
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize(
    ("block_type", "block_bytes", "fp16s", "scales"),
    [("Q4_K", 19, (0, 4), (4, 16)), ("Q5_K", 23, (0, 4), (4, 16)), ("Q2_K", 11, (80, 84), (0, 16))],
)
def test_k_quants_keep_their_integer_scales(block_type, block_bytes, fp16s, scales):
    """Q4_K and Q5_K hold their sub-blocks' 6-bit scales and mins a byte each under the
    super-block's d and -dmin in fp32: 19 and 23 bytes a block of 32 (the file's 18 and 22),
    where fp32 scales and offsets per block took 24 and 28; Q2_K its 4-bit ones per 16, as the
    file's bytes: 11 (the file's 10.5); the largest fp16 d and dmin times sc and m at their
    largest (and 0) load bit for bit too."""
    raw = _random_blocks(block_type, np.random.default_rng(11))
    blocks = raw.reshape(ROWS, K // 256, -1)
    blocks[0, :, slice(*fp16s)] = np.array([65504.0, 65504.0], dtype=np.float16).view(np.uint8)
    blocks[0, :, slice(*scales)] = 0xFF  # every scale and min at its largest (63, Q2_K's 15)
    blocks[1, :, slice(*scales)] = 0x00
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[block_type]).copy())
    weight = from_gguf_blocks(block_type, raw, K)
    assert weight.nbytes == ROWS * K // 32 * block_bytes
    assert torch.equal(weight.dequantize(), reference)


def _needs(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not path.exists(), reason=f"{path.name} not fetched")


@pytest.mark.parametrize(
    "path, native_types",
    [
        pytest.param(SMOLLM2_GGUF, {"Q8_0", "Q4_1"}, marks=_needs(SMOLLM2_GGUF)),
        pytest.param(GEMMA_GGUF, {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}, marks=_needs(GEMMA_GGUF)),
    ],
    ids=["smollm2-q4_1", "gemma3-q4_k_m"],
)
def test_real_files_load_as_transformers_dequantises_them(path, native_types):
    """Against transformers' own GGUF loading (every tensor dequantised to fp32): a dense load
    equals it tensor for tensor; in the default mode the tensors left dense are equal, and each
    block tensor's records dequantise to the very same weight (Llama's q/k rows in transformers'
    order), Gemma's Q6_K ffn_down included (int6)."""
    config = EngineConfig(model=str(path), num_threads=2)
    loaded = load_model(config)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    # every weight dense (--quantization none, a GPU): each the very tensor transformers loads
    # (Gemma's embedding was once redrawn at random by the init of its scaled-embedding buffer)
    dense = load_model(EngineConfig(model=str(path), quantization="none", num_threads=2))
    for name, tensor in dense.model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    del dense
    ours = loaded.model.state_dict()
    assert ours.keys() == reference.keys()
    meta = {name for name, tensor in ours.items() if tensor.is_meta}
    for name in ours.keys() - meta:
        assert torch.equal(ours[name], reference[name]), name
    # the tensors' block types from the engine's header reader (test_gguf_file.py holds it to
    # gguf's GGUFReader, which takes seconds more to read Gemma's)
    types = {name: t.tensor_type.name for name, t in GgufFile(path).tensors.items()}
    by_hf = {hf: name for name, hf in loaded.gguf._hf_names.items() if name in types}
    tied: dict[int, list[str]] = {}  # a tied weight's names (the embedding's and the head's)
    for name, param in loaded.model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    seen = set()
    for names in (names for names in tied.values() if names[0] in meta):
        weight = loaded.gguf.native(names)
        assert weight is not None, names
        assert all(torch.equal(weight.dequantize(), reference[n]) for n in names), names
        seen.add(next(types[by_hf[n]] for n in names if n in by_hf))
    assert seen == native_types
    if path == GEMMA_GGUF:
        assert ours["model.layers.0.mlp.down_proj.weight"].is_meta  # Q6_K: int6 records
    fast = prepare_cpu_fast_path(loaded, config)
    assert fast.narrow is not None and loaded.gguf is None
    assert not any(p.is_meta for p in loaded.model.parameters())
    assert isinstance(loaded.model.get_input_embeddings(), QuantizedEmbedding)
    # both files tie the lm_head to the table: the lookups read the head's packed rows, no copy
    assert loaded.model.get_input_embeddings().records is None
    ids = torch.tensor([[2, 651, 6037, 573, 1105, 11]])
    scaled = loaded.model.get_input_embeddings()(ids)
    dense_rows = reference["model.embed_tokens.weight"][ids]
    if path == GEMMA_GGUF:  # Gemma multiplies its embeddings by sqrt(hidden), in the weights' dtype
        dense_rows = dense_rows * torch.tensor(640**0.5, dtype=torch.float32)
    assert torch.equal(scaled, dense_rows)
