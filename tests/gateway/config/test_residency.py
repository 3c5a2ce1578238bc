"""Residency: ``gateway.memory`` and each model's ``residency``, ``idle_ttl_s``, ``priority`` and
``memory_estimate`` — a test per rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import MemoryBudget
from tests.gateway.config.documents import EXTERNAL, document, gateway_doc, parsed, problems_of


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    return tmp_path


def local(**keys):
    return {"name": "l", "source": "m.gguf", **keys}


def test_absent_settings_are_the_defaults(base):
    config = parsed(document([local()]), base)
    assert config.gateway.memory == MemoryBudget()
    model = config.models[0]
    assert (model.residency, model.on_demand, model.idle_ttl_s, model.priority) == (
        "pinned", False, 600.0, 0,
    )  # fmt: skip
    assert model.memory_estimate is None


def test_given_values_are_read(base):
    doc = document(
        [
            local(
                residency="on_demand",
                idle_ttl_s=30,
                priority=5,
                memory_estimate="1GiB",
            )
        ],
        gateway={"memory": {"cpu_bytes": "8GiB", "gpu_fraction": 0.5, "park": False}},
    )
    config = parsed(doc, base)
    assert config.gateway.memory == MemoryBudget(cpu_bytes=8 * 2**30, gpu_fraction=0.5, park=False)
    model = config.models[0]
    assert model.on_demand and (model.idle_ttl_s, model.priority) == (30.0, 5)
    assert model.memory_estimate == 2**30


def test_cpu_budget_auto_means_a_share_of_ram():
    memory = parsed(gateway_doc(memory={"cpu_bytes": "auto", "auto_cpu_share": 0.5})).gateway.memory
    assert memory == MemoryBudget(cpu_bytes=None, auto_cpu_share=0.5)


@pytest.mark.parametrize(
    ("memory", "problem"),
    [
        ({"cpu_bytes": "lots"}, "gateway.memory.cpu_bytes: invalid size 'lots'"),
        ({"auto_cpu_share": 1.5}, "gateway.memory.auto_cpu_share: must be > 0 and <= 1"),
        ({"gpu_fraction": 0.99}, "gateway.memory.gpu_fraction: must be > 0 and <= 0.95"),
        ({"swap": True}, "gateway.memory.swap: unknown key"),
        ({"park": "yes"}, "gateway.memory.park: must be true or false"),
    ],
)
def test_memory_values_are_checked(memory, problem):
    (found,) = problems_of(gateway_doc(memory=memory))
    assert problem in found


def test_residency_must_be_a_known_kind(base):
    (found,) = problems_of(document([local(residency="lazy")]), base)
    assert "models[0].residency: must be one of pinned, on_demand, got 'lazy'" in found


def test_only_local_models_are_on_demand():
    (found,) = problems_of(document([{**EXTERNAL, "residency": "on_demand"}]))
    assert "residency: on_demand applies to local models" in found


@pytest.mark.parametrize("key", ["idle_ttl_s", "priority"])
def test_ttl_and_priority_need_on_demand(base, key):
    (found,) = problems_of(document([local(**{key: 5})]), base)
    assert f"models[0].{key}: applies to on_demand models only" in found


def test_memory_estimate_is_local_only():
    (found,) = problems_of(document([{**EXTERNAL, "memory_estimate": "1GiB"}]))
    assert "memory_estimate: only applies to local models" in found


def test_pinned_gpu_models_must_fit_together_on_demand_ones_each_alone(base):
    gpu = {"device": "cuda", "gpu_memory_fraction": 0.6}
    on_demand = {**gpu, "residency": "on_demand"}
    models = [local(name="a", **on_demand), local(name="b", **on_demand), local(name="c", **gpu)]
    assert len(parsed(document(models), base).models) == 3  # 1.8 in all, never all awake
    (found,) = problems_of(document([local(name="a", **gpu), local(name="b", **gpu)]), base)
    assert "pinned models sums to 1.20" in found
    (found,) = problems_of(document([local(replicas=2, **on_demand)]), base)
    assert "l: gpu_memory_fraction x replicas exceeds 0.95" in found
