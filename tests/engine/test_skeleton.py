"""A model rebuilt from its snapshot (engine.model.skeleton) runs the lean forward it was checked
with: bit for bit for every architecture the lean forward runs; a real GGUF's second start takes
it without importing transformers' modeling (torch._dynamo), and generates what the first did; a
snapshot that no longer gives a lean forward is removed; trees it cannot rebuild the same are
refused, and unreadable snapshots ignored."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model import skeleton
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ModelRunner
from engine.model.step_batch import StepBatch
from tests.conftest import REPO_ROOT
from tests.engine.test_lean_forward import ARCHITECTURES, model_dir  # noqa: F401 (fixture)

MAX_MODEL_LEN = 128


def engine_config(folder: Path) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        num_threads=1,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=64,
        kv_cache_memory=4 * 2**20,
    )


def rebuilt(loaded: LoadedModel, path: Path) -> LoadedModel:
    """``loaded`` with its model rebuilt from its snapshot (through JSON, as the cache keeps it),
    holding copies of the same weights."""
    record = skeleton.describe(loaded.model, loaded.eos_token_ids)
    snapshot = skeleton.Snapshot.from_json(record.to_json())
    model = skeleton.restore(snapshot, loaded.hf_config)
    weights = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    model.load_state_dict(weights, assign=True)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return replace(loaded, model=model, snapshot=skeleton.SnapshotSlot(path, found=snapshot))


def steps(vocab: int) -> list[StepBatch]:
    """Two prompts' chunked prefill, then decode steps of both (as the runner's load check)."""
    ids = torch.randint(vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    tables = [list(range(0, 4)), list(range(4, 8))]
    batches = [
        StepBatch(ids[:20], [*range(12), *range(8)], [12, 8], [12, 8], tables, [11, 19]),
        StepBatch(ids[20:30], [*range(12, 17), *range(8, 13)], [5, 5], [17, 13], tables, [4, 9]),
    ]
    for step in range(4):
        batches.append(StepBatch(ids[30 + 2 * step : 32 + 2 * step], [17 + step, 13 + step],
                                 [1, 1], [18 + step, 14 + step], tables, [0, 1]))  # fmt: skip
    return batches


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_rebuilt_model_runs_the_same_lean_forward_bit_for_bit(
    arch: str,
    model_dir: Callable[[str], Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Dense weights (a snapshot is taken of GGUF files on narrow weights, which
    test_a_real_gguf_starts_again_without_transformers_modeling runs)."""
    config = engine_config(model_dir(arch))
    loaded = load_model(config)
    restored = rebuilt(loaded, tmp_path / "snapshot.json")
    reference = ModelRunner(config, loaded, MAX_MODEL_LEN)  # checked against transformers
    runner = ModelRunner(config, restored, MAX_MODEL_LEN)
    assert reference.lean is not None and runner.lean is not None
    assert type(runner.model).__name__ == "SkeletonCausalLM"
    for batch in steps(loaded.vocab_size):
        expected, logits = reference.execute(batch), runner.execute(batch)
        assert torch.equal(logits, expected)


def test_a_snapshot_without_a_lean_forward_is_removed(
    model_dir: Callable[[str], Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    config = engine_config(model_dir("llama"))
    restored = rebuilt(load_model(config), tmp_path / "snapshot.json")
    restored.snapshot.path.write_text("{}")
    # an activation the lean forward does not run: it builds no lean forward of this tree
    layers = restored.model.model.layers
    for layer in layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    with pytest.raises(ModelLoadError, match="snapshot is removed"):
        ModelRunner(config, restored, MAX_MODEL_LEN)
    assert not restored.snapshot.path.exists()


def test_rotary_types_that_rescale_with_the_length_are_not_recorded() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    with pytest.raises(skeleton.NotDescribable, match="dynamic"):
        skeleton.describe(LlamaForCausalLM(config), {0})


def test_unreadable_or_older_snapshots_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "snapshot.json"
    assert skeleton.read(path) is None  # none yet: nothing logged
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert skeleton.read(path) is None
    path.write_text(json.dumps({"version": skeleton.SNAPSHOT_VERSION - 1, "nodes": []}))
    assert skeleton.read(path) is None
    assert caplog.text.count("ignoring the unreadable model snapshot") == 2


def test_the_key_follows_the_file_and_the_options() -> None:
    key = skeleton.snapshot_key("a" * 64, {"dtype": "torch.float32"})
    assert key == skeleton.snapshot_key("a" * 64, {"dtype": "torch.float32"})
    assert key != skeleton.snapshot_key("b" * 64, {"dtype": "torch.float32"})
    assert key != skeleton.snapshot_key("a" * 64, {"dtype": "torch.bfloat16"})


_START = """
import sys
from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams
llm = LLM(sys.argv[1], num_threads=2, kv_cache_memory=32 * 2**20, max_model_len=256)
params = SamplingParams(max_tokens=12, temperature=0.0)
out = llm.generate(["The capital of France is", "def fib(n):"], params)
print([o.outputs[0].token_ids for o in out])
print(llm.engine.runner.snapshot.restored, "torch._dynamo" in sys.modules)
"""


def test_a_real_gguf_starts_again_without_transformers_modeling(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "MODELYARD_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "2"}

    def start() -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _START, str(smollm2_gguf)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.splitlines()[-2:]

    first_tokens, first = start()
    assert first == "False True"  # transformers' model, checked; its snapshot written
    assert len(list((tmp_path / "snapshots").glob("*.json"))) == 1
    again_tokens, again = start()
    assert again == "True False"  # rebuilt: no transformers modeling, no torch._dynamo
    assert again_tokens == first_tokens
