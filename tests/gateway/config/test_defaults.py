"""The ``defaults`` section: engine settings for local models that do not set their own (a model's
own value wins), each key checked as a model's would be."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ModelDefaults
from tests.gateway.config.documents import document, parsed, problems_of


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    return tmp_path


def local(**keys):
    return {"name": "l", "source": "m.gguf", **keys}


def engine_settings(config) -> ModelDefaults:
    return ModelDefaults(
        config.device,
        config.max_model_len,
        config.max_num_seqs,
        config.gpu_memory_fraction,
        config.kv_cache_memory,
    )


SETTINGS = {
    "device": "cpu",
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "gpu_memory_fraction": 0.25,
    "kv_cache_memory": "256MiB",
}


def test_without_defaults_local_models_get_modeldefaults(base_dir):
    config = parsed(document([local()]), base_dir).models[0]
    assert engine_settings(config) == ModelDefaults()


def test_defaults_apply_to_local_models(base_dir):
    config = parsed(document([local()], defaults=SETTINGS), base_dir).models[0]
    assert engine_settings(config) == ModelDefaults("cpu", 1024, 4, 0.25, 256 * 2**20)


def test_a_models_own_value_wins(base_dir):
    own = {
        "device": "cuda",
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "gpu_memory_fraction": 0.5,
        "kv_cache_memory": 2**20,
    }
    config = parsed(document([local(**own)], defaults=SETTINGS), base_dir).models[0]
    assert engine_settings(config) == ModelDefaults("cuda", 2048, 8, 0.5, 2**20)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("device", "tpu", "must be one of auto, cpu, cuda, got 'tpu'"),
        ("max_model_len", 15, "must be >= 16, got 15"),
        ("max_num_seqs", 0, "must be >= 1, got 0"),
        ("gpu_memory_fraction", 0, "must be > 0 and <= 1, got 0"),
        ("gpu_memory_fraction", 1.5, "must be > 0 and <= 1, got 1.5"),
        (
            "kv_cache_memory",
            "lots",
            "invalid size 'lots': expected e.g. 512MiB, 2GiB or a byte count",
        ),
        ("replicas", 2, "unknown key"),
    ],
)
def test_default_rules_are_a_models_rules(base_dir, key, value, problem):
    assert problems_of(document([local()], defaults={key: value}), base_dir) == [
        f"models.yaml: defaults.{key}: {problem}"
    ]
    if key != "replicas":  # the model's own key, checked the same way
        assert problems_of(document([local(**{key: value})]), base_dir) == [
            f"models.yaml: models[0].{key}: {problem}"
        ]
