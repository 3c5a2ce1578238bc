"""Admission: ``gateway.admission``, each model's ``admission`` and ``queue`` (its line's bounds),
and each API key's ``priority``, ``weight`` and ``sheddable`` — a test per rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import AdmissionSettings, ModelAdmission, QueueSettings
from tests.gateway.config.documents import EXTERNAL, document, gateway_doc, parsed, problems_of


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    return tmp_path


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv("A_KEY", "sk-a")


def local(**keys):
    return {"name": "l", "source": "m.gguf", **keys}


def key(**fields):
    return gateway_doc(auth={"keys": [{"name": "a", "key_env": "A_KEY", **fields}]})


def test_absent_settings_are_the_defaults(base, key_env):
    config = parsed({**key(), "models": [local(), EXTERNAL]}, base)
    assert config.gateway.admission == AdmissionSettings(policy="fair")
    for model in config.models:
        assert model.admission == ModelAdmission(max_in_flight=None, policy="fair")
        assert model.queue == QueueSettings(max_requests=64, max_wait_s=120.0, failed_retry_s=30)
    (api_key,) = config.gateway.auth.keys
    assert (api_key.priority, api_key.weight, api_key.sheddable) == (0, 1.0, False)


def test_slots_default_to_a_local_engines_batch_and_256_for_an_upstream(base):
    config = parsed(document([local(max_num_seqs=5), EXTERNAL]), base)
    assert [model.max_in_flight for model in config.models] == [5, 256]


def test_given_values_are_read(base):
    model = local(
        admission={"max_in_flight": 2, "policy": "fcfs"},
        queue={"max_requests": 3, "max_wait_s": 2.5, "failed_retry_s": 1.5},
    )
    (config,) = parsed(document([model]), base).models
    assert config.admission == ModelAdmission(max_in_flight=2, policy="fcfs")
    assert config.max_in_flight == 2
    assert config.queue == QueueSettings(max_requests=3, max_wait_s=2.5, failed_retry_s=1.5)


def test_a_models_policy_defaults_to_the_gateways_and_may_override_it():
    doc = document(
        [{**EXTERNAL, "name": "a"}, {**EXTERNAL, "name": "b", "admission": {"policy": "fair"}}],
        gateway={"admission": {"policy": "fcfs"}},
    )
    assert [m.admission.policy for m in parsed(doc).models] == ["fcfs", "fair"]


def test_a_keys_admission_fields_are_read(key_env):
    (api_key,) = parsed(key(priority=-3, weight=2.5, sheddable=True)).gateway.auth.keys
    assert (api_key.priority, api_key.weight, api_key.sheddable) == (-3, 2.5, True)


@pytest.mark.parametrize(
    ("admission", "problem"),
    [
        ({"policy": "lifo"}, "gateway.admission.policy: must be one of fair, fcfs, got 'lifo'"),
        ({"order": "fair"}, "gateway.admission.order: unknown key"),
    ],
)
def test_gateway_admission_values_are_checked(admission, problem):
    (found,) = problems_of(gateway_doc(admission=admission))
    assert found == f"models.yaml: {problem}"


@pytest.mark.parametrize(
    ("admission", "problem"),
    [
        ({"max_in_flight": 0}, "admission.max_in_flight: must be >= 1, got 0"),
        ({"max_in_flight": 1.5}, "admission.max_in_flight: must be an integer, got 1.5"),
        ({"policy": "lifo"}, "admission.policy: must be one of fair, fcfs, got 'lifo'"),
        ({"slots": 2}, "admission.slots: unknown key"),
    ],
)
def test_model_admission_values_are_checked(admission, problem):
    (found,) = problems_of(document([{**EXTERNAL, "admission": admission}]))
    assert found == f"models.yaml: models[0].{problem}"


@pytest.mark.parametrize(
    ("queue", "problem"),
    [
        ({"max_requests": -1}, "queue.max_requests: must be >= 0, got -1"),
        ({"max_wait_s": 0}, "queue.max_wait_s: must be > 0, got 0"),
        ({"failed_retry_s": 0}, "queue.failed_retry_s: must be > 0, got 0"),
        ({"depth": 3}, "queue.depth: unknown key"),
    ],
)
def test_queue_values_are_checked(base, queue, problem):
    (found,) = problems_of(document([local(queue=queue)]), base)
    assert found == f"models.yaml: models[0].{problem}"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"priority": 1001}, "priority: must be >= -1000 and <= 1000, got 1001"),
        ({"priority": 1.5}, "priority: must be an integer, got 1.5"),
        ({"weight": 0}, "weight: must be > 0 and <= 1000.0, got 0"),
        ({"weight": "heavy"}, "weight: must be a number, got 'heavy'"),
        ({"sheddable": "yes"}, "sheddable: must be true or false, got 'yes'"),
    ],
)
def test_key_admission_values_are_checked(key_env, fields, problem):
    (found,) = problems_of(key(**fields))
    assert found == f"models.yaml: gateway.auth.keys[0].{problem}"
