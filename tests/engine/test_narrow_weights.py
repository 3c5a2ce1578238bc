"""--quantization: which weights go narrow and from where, the load-time probe, the refusals, and
the engine running on them (lean forward included)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams
from engine.errors import ModelLoadError
from engine.model import cache_dir
from engine.model.cpu import narrow_cache
from engine.model.cpu.fast_path import prepare_cpu_fast_path
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder
from engine.model.cpu.lean_forward import LeanLlamaForward
from engine.model.cpu.narrow_weights import check_quantization
from engine.model.cpu.quant_formats import QuantizedWeight
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear
from engine.model.loader import load_model
from tests.conftest import SMOLLM2_GGUF

pytestmark = pytest.mark.skipif(quant_gemm.library() is None, reason="no C compiler here")
needs_smollm2 = pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="SmolLM2 GGUF not fetched")


def _prepared(model: str, quantization: str):
    config = EngineConfig(model=model, quantization=quantization, num_threads=2)
    loaded = load_model(config)
    return loaded, prepare_cpu_fast_path(loaded, config)


def _linears(model: nn.Module) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, QuantizedLinear)) or type(module).__name__ in (
            "PrepackedLinear",
        ):
            name = getattr(module, "fmt", type(module).__name__)
            kinds[name] = kinds.get(name, 0) + 1
    return kinds


@needs_smollm2
@pytest.mark.parametrize(
    ("quantization", "native", "quantized", "formats"),
    [
        # 30 layers x 7 Q4_1 linears, the Q8_0 embedding (its tied lm_head shares the records),
        # in int8h (int8 with the file's fp16 scales) in every mode
        ("auto", 211, 0, {"int4", "int8h"}),
        ("int4", 211, 0, {"int4", "int8h"}),  # the vocabulary stays int8 in int4 mode
        ("int8", 1, 210, {"int8", "int8h"}),
    ],
)
def test_smollm2_gguf_loads_its_own_blocks(quantization, native, quantized, formats):
    loaded, fast = _prepared(str(SMOLLM2_GGUF), quantization)
    report = fast.narrow
    assert (report.native, report.quantized) == (native, quantized)
    assert set(report.bytes_by_format) == formats
    model = loaded.model
    assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    embedding = model.get_input_embeddings()
    assert model.lm_head.fmt == embedding.fmt == "int8h"  # the tied table, loaded once
    # every linear is narrow (q/k/v and gate/up fused: 4 GEMMs a layer, plus the lm_head)
    assert sum(_linears(model).values()) == 30 * 4 + 1
    assert LeanLlamaForward.build(model) is not None


def test_hf_folders_stay_dense_unless_asked(tiny_llama_dir):
    loaded, fast = _prepared(str(tiny_llama_dir), "auto")
    assert fast.narrow is None
    for fmt in ("int8", "int4"):
        loaded, fast = _prepared(str(tiny_llama_dir), fmt)
        assert fast.narrow.quantized > 0 and fast.narrow.native == 0
        assert fmt in _linears(loaded.model)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("head_in_call", [True, False])
def test_the_engine_generates_on_narrow_weights(tiny_llama_dir, fmt, head_in_call, monkeypatch):
    """The engine on narrow weights, lean forward and paged attention included, gives the tokens
    the same narrow model gives through transformers' own forward (greedy); its decode steps run
    every layer and the lm_head in one call (NarrowDecoder), the prefill layer by layer. Without
    the head in the call (an lm_head not on narrow weights) the decode steps run it after."""
    calls = {"decoder": 0, "lm_head": 0}
    lm_head: list[nn.Module] = []  # the engine's, once loaded
    decode, linear = NarrowDecoder.__call__, QuantizedLinear.forward

    def counted_decode(self, *args, **kwargs):
        calls["decoder"] += 1
        return decode(self, *args, **kwargs)

    def counted_linear(self, x):
        calls["lm_head"] += self in lm_head
        return linear(self, x)

    monkeypatch.setattr(NarrowDecoder, "__call__", counted_decode)
    monkeypatch.setattr(QuantizedLinear, "forward", counted_linear)
    llm = LLM(str(tiny_llama_dir), quantization=fmt, num_threads=2)
    runner = llm.engine.runner
    assert runner.cpu.narrow is not None and runner.lean is not None
    lean = runner.lean
    assert lean.narrow.has_lm_head
    if not head_in_call:
        qkv_width = (lean.num_heads + 2 * lean.num_kv_heads) * lean.head_dim
        lean.narrow = NarrowDecoder.build(lean.layers, qkv_width, lean.final_norm, None)
    lm_head.append(lean.lm_head)
    prompt = [5, 9, 17, 33, 2, 11]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    calls.update(decoder=0, lm_head=0)  # not the load's probe
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert calls["decoder"] == 7  # the 7 decode steps after the prompt's
    # the prompt's, and without the head in the call each decode step's
    assert calls["lm_head"] == (1 if head_in_call else 8)
    reference, _ = _prepared(str(tiny_llama_dir), fmt)  # the same weights, own attention
    ids = torch.tensor([prompt])
    expected = []
    with torch.inference_mode():
        for _ in range(8):
            logits = reference.model(input_ids=ids, use_cache=False).logits
            token = int(logits[0, -1].argmax())
            expected.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert out == expected


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_narrow_formats_are_refused_where_they_cannot_run(fmt):
    config = EngineConfig(model="unused", quantization=fmt)
    with pytest.raises(ModelLoadError, match=r"CPU only.*supported formats are none and auto"):
        check_quantization(config, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ModelLoadError, match="--dtype float32"):
        check_quantization(config, torch.device("cpu"), torch.bfloat16)
    for quantization in ("auto", "none"):  # the dense dtype is the format there
        check_quantization(
            EngineConfig(model="unused", quantization=quantization),
            torch.device("cuda"),
            torch.bfloat16,
        )


def test_narrow_weights_are_cached_per_checkpoint_and_mode(
    tiny_llama_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """The second load of a checkpoint in a mode reads the first one's choices: the same
    weights, without quantising again; another mode or a changed checkpoint misses."""
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=str(tiny_llama_dir), quantization="int4", num_threads=2)
    _loaded_twice_the_same(config)
    assert narrow_cache.cache_path(tiny_llama_dir, "int4") != narrow_cache.cache_path(
        tiny_llama_dir, "int8"
    )
    (tiny_llama_dir / "config.json").touch()  # a changed checkpoint: another key
    assert not _narrow_report(config)[0].cached


def _narrow_report(config: EngineConfig):
    """A load's narrow-weight report, and the packed weights it made, by buffer name (each a
    view of the packed cache's mapped file)."""
    loaded = load_model(config)
    fast = prepare_cpu_fast_path(loaded, config)
    buffers = {n: b for n, b in loaded.model.named_buffers() if n.endswith("packed")}
    assert fast.narrow.mapped is not None
    assert all(fast.narrow.mapped.holds(b.data_ptr()) for b in buffers.values())
    return fast.narrow, {n: b.clone() for n, b in buffers.items()}


def _loaded_twice_the_same(config: EngineConfig):
    """Loads ``config`` twice: the first misses the cache, the second reads it and maps the very
    same packed weights; the first's report."""
    first, first_packed = _narrow_report(config)
    second, second_packed = _narrow_report(config)
    assert not first.cached and second.cached
    assert first.mapped.entries == second.mapped.entries
    assert (second.native, second.quantized) == (first.native, first.quantized)
    assert first_packed.keys() == second_packed.keys() and first_packed
    assert all(torch.equal(first_packed[n], second_packed[n]) for n in first_packed)
    return first


@needs_smollm2
def test_a_gguf_files_own_blocks_are_cached_as_records(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A GGUF's second start reads the records its first made of the file's blocks (for Gemma 3
    270M 1-2 s of its start) from the cache, weight by weight as each is packed: the same kernel
    layout, the file's blocks counted as its own."""
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=str(SMOLLM2_GGUF), num_threads=2)
    first = _loaded_twice_the_same(config)
    assert (first.native, first.quantized) == (211, 0)
    (path,) = (tmp_path / "cache" / "narrow").glob("*.safetensors")
    cached = narrow_cache.load(path)
    assert cached is not None and len(cached) > 200
    # every weight is in the packed file (the embedding reads the tied head's rows): the
    # records' cache describes them and holds no second copy of the weights
    assert cached.packed == [tuple(e[:3]) for e in first.mapped.entries]
    assert all(w is None or w.records.is_meta for w, _ in cached.values())
    assert path.stat().st_size < 2**20
    # without that packed file (gone, or another kernel build's) the description is no use:
    # the weights come from the file's blocks again, into a new packed file
    _, before = _narrow_report(config)
    for packed in (tmp_path / "cache" / "packed").glob("*.bin"):
        packed.unlink()
    again, after = _narrow_report(config)
    assert not again.cached and again.mapped.entries == first.mapped.entries
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_table_the_model_reads_itself_keeps_its_records_in_the_cache(
    tiny_llama_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """An embedding not tied to the lm_head looks its rows up in its own records: those stay in
    the records' cache, beside the packed weights' descriptions."""
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=str(tiny_llama_dir), quantization="int8", num_threads=2)
    _loaded_twice_the_same(config)
    (path,) = (tmp_path / "cache" / "narrow").glob("*.safetensors")
    cached = narrow_cache.load(path)
    kept = {name for name, (w, _) in cached.items() if w is not None and not w.records.is_meta}
    assert kept == {"model.embed_tokens.weight"} and cached.packed is not None
    loaded = load_model(config)
    prepare_cpu_fast_path(loaded, config)
    table = loaded.model.get_input_embeddings()
    assert isinstance(table, QuantizedEmbedding) and not table.records.is_meta


def test_cache_files_nobody_read_for_two_weeks_go_at_the_next_write(tmp_path):
    """A read touches its file; a write removes the files not read for STALE_AFTER_S, so the
    records of GGUFs taken out of models.yaml (~1.3x each file) do not pile up."""
    weight = QuantizedWeight("int8", 32, torch.zeros(4, 36, dtype=torch.uint8))
    folder = tmp_path / "narrow"
    old, kept, new = (folder / f"{name}.safetensors" for name in ("old", "kept", "new"))
    for path in (old, kept):
        narrow_cache.save(path, {"w": (weight, True)})
    weeks_ago = time.time() - cache_dir.STALE_AFTER_S - 60
    for path in (old, kept):
        os.utime(path, (weeks_ago, weeks_ago))
    assert narrow_cache.load(kept) is not None  # read: touched
    narrow_cache.save(new, {"w": (weight, False)})
    assert not old.exists() and kept.exists() and new.exists()
    loaded_weight, native = narrow_cache.load(new)["w"]
    assert not native and torch.equal(loaded_weight.records, weight.records)


def test_a_cache_write_behind_the_load_is_joined_before_its_file_is_read(tmp_path):
    """The records' file is written on a thread of its own while the load goes on; the next
    load (or the engine, before it is ready) waits for it."""
    gate, written = threading.Event(), []

    def slow_write() -> None:
        gate.wait(10)
        written.append(True)

    cache_dir.write_behind(slow_write)
    assert written == []  # the load went on
    gate.set()
    cache_dir.wait_for_writes()
    assert written == [True]
    cache_dir.wait_for_writes()  # nothing left to join
