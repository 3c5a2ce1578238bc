"""One entry of ``models``: names and aliases, ``upstreams`` or ``source``, the keys only local
models take, health path, upstream key, limits, affinity; and the rules across models (names
unique, the GPU's memory, the only engine's spin-wait)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import Affinity, ModelLimits
from tests.gateway.config.documents import EXTERNAL, document, parsed, problems, problems_of

LOCAL_KEYS = {
    "replicas": 2,
    "device": "cpu",
    "gpu_memory_fraction": 0.5,
    "kv_cache_memory": "1GiB",
    "engine_args": ["--dtype", "bfloat16"],
}


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def local(**keys):
    return {"name": "l", "source": "m.gguf", **keys}


def one_problem(model: dict, base_dir: Path | None = None) -> str:
    found = problems_of(document([model]), base_dir)
    assert len(found) == 1, found
    return found[0]


def test_an_external_model():
    model = {
        "name": "big",
        "aliases": ["default"],
        "upstreams": ["http://h1:8000/", "https://h2/v1"],
        "upstream_model": "org/Big",
        "health_path": "/health",
    }
    config = parsed(document([model])).models[0]
    assert config.upstreams == ("http://h1:8000", "https://h2")  # the gateway appends /v1/...
    assert (config.local, config.replicas, config.wire_name) == (False, 2, "org/Big")
    assert (config.aliases, config.health_path) == (("default",), "/health")


def test_a_local_model_resolves_its_source_against_the_files_folder(model_file):
    config = parsed(document([local(replicas=2)]), model_file.parent).models[0]
    assert config.source == str(model_file) and config.local and config.replicas == 2
    assert parsed(document([local(source=str(model_file))])).models[0].source == str(model_file)


def test_a_name_is_required():
    assert one_problem({"upstreams": ["http://h:1"]}) == "models.yaml: models[0].name: is required"


@pytest.mark.parametrize("name", ["-x", "a b", "x" * 129])
def test_names_take_letters_digits_and_a_few_signs(name):
    assert one_problem({**EXTERNAL, "name": name}) == (
        f"models.yaml: models[0].name: {name!r} may only contain letters, digits and ._:/@+- "
        "(max 128)"
    )


def test_aliases_take_the_same_signs():
    assert one_problem({**EXTERNAL, "aliases": ["ok:1", "not ok"]}) == (
        "models.yaml: models[0].aliases: 'not ok' may only contain letters, digits and ._:/@+-"
    )


def test_names_and_aliases_are_unique_across_the_file():
    found = problems_of(document([{**EXTERNAL, "aliases": ["a"]}, {**EXTERNAL, "name": "a"}]))
    assert found == ["models.yaml: models[1]: name or alias 'a' is already used by models[0]"]


@pytest.mark.parametrize("url", ["ftp://h", "h:80", "http://"])
def test_upstreams_are_http_urls(url):
    assert one_problem({"name": "x", "upstreams": ["http://ok:1", url]}) == (
        f"models.yaml: models[0].upstreams[1]: {url!r} is not an http(s) URL"
    )


@pytest.mark.parametrize("url", ["http://h/?a=1", "http://h/#top"])
def test_upstreams_have_no_query_or_fragment(url):
    assert one_problem({"name": "x", "upstreams": ["http://ok:1", url]}) == (
        f"models.yaml: models[0].upstreams[1]: {url!r} must not have a query or fragment"
    )


def test_an_only_upstream_that_is_refused_leaves_none():
    assert problems_of(document([{"name": "x", "upstreams": ["ftp://h"]}])) == [
        "models.yaml: models[0].upstreams[0]: 'ftp://h' is not an http(s) URL",
        "models.yaml: models[0].upstreams: must list at least one URL",
    ]


def test_upstreams_are_listed_once():
    assert one_problem({"name": "x", "upstreams": ["http://h:1", "http://h:1/v1"]}) == (
        "models.yaml: models[0].upstreams: lists the same URL twice"
    )


def test_a_model_has_source_or_upstreams_not_both(model_file):
    found = one_problem(local(upstreams=["http://h:1"]), model_file.parent)
    assert found == (
        "models.yaml: models[0].source: a model has either `source` (spawned locally) or "
        "`upstreams`, not both"
    )


def test_a_model_needs_source_or_upstreams():
    assert one_problem({"name": "x"}) == (
        "models.yaml: models[0]: needs `source` (a local model to spawn) or `upstreams` (URLs to "
        "route to)"
    )


def test_upstreams_list_at_least_one_url():
    assert one_problem({"name": "x", "upstreams": []}) == (
        "models.yaml: models[0].upstreams: must list at least one URL"
    )


def test_a_source_must_exist(tmp_path):
    assert one_problem(local(), tmp_path) == (
        f"models.yaml: models[0].source: {tmp_path / 'm.gguf'} does not exist"
    )


@pytest.mark.parametrize(("key", "value"), LOCAL_KEYS.items())
def test_engine_keys_apply_only_to_local_models(key, value):
    assert one_problem({**EXTERNAL, key: value}) == (
        f"models.yaml: models[0].{key}: only applies to local models (with `source`)"
    )


def test_local_models_take_the_engine_keys(model_file):
    config = parsed(document([local(**LOCAL_KEYS)]), model_file.parent).models[0]
    assert (config.replicas, config.device, config.gpu_memory_fraction) == (2, "cpu", 0.5)
    assert (config.kv_cache_memory, config.engine_args) == (2**30, ("--dtype", "bfloat16"))


@pytest.mark.parametrize(("replicas", "problem"), [(0, "got 0"), (65, "got 65")])
def test_replicas_are_1_to_64(model_file, replicas, problem):
    assert one_problem(local(replicas=replicas), model_file.parent) == (
        f"models.yaml: models[0].replicas: must be >= 1 and <= 64, {problem}"
    )


def test_a_health_path_starts_with_a_slash():
    assert one_problem({**EXTERNAL, "health_path": "ready"}) == (
        "models.yaml: models[0].health_path: must start with '/', got 'ready'"
    )


def test_an_upstream_key_comes_from_a_set_variable(monkeypatch):
    monkeypatch.setenv("REMOTE_KEY", "sk-remote")
    config = parsed(document([{**EXTERNAL, "api_key_env": "REMOTE_KEY"}])).models[0]
    assert config.api_key == "sk-remote" and "sk-remote" not in repr(config)
    monkeypatch.delenv("REMOTE_KEY")
    assert one_problem({**EXTERNAL, "api_key_env": "REMOTE_KEY"}) == (
        "models.yaml: models[0].api_key_env: environment variable REMOTE_KEY is not set or empty"
    )


def test_limits_and_affinity_defaults_and_values():
    assert parsed(document()).models[0].limits == ModelLimits()
    assert parsed(document()).models[0].affinity == Affinity()
    model = {
        **EXTERNAL,
        "limits": {"rpm": 1, "tpm": 2, "max_concurrency": 3},
        "affinity": {"by": "prefix", "prefix_chars": 1, "max_extra_load": 0},
    }
    config = parsed(document([model])).models[0]
    assert config.limits == ModelLimits(1, 2, 3)
    assert config.affinity == Affinity("prefix", 1, 0)


@pytest.mark.parametrize(
    ("section", "key", "value", "problem"),
    [
        ("limits", "rpm", 0, "must be >= 1, got 0"),
        ("limits", "tpm", "many", "must be an integer, got 'many'"),
        ("limits", "max_concurrency", 0, "must be >= 1, got 0"),
        ("limits", "rps", 1, "unknown key"),
        ("affinity", "by", "session", "must be one of none, prefix, user, got 'session'"),
        ("affinity", "prefix_chars", 0, "must be >= 1, got 0"),
        ("affinity", "max_extra_load", -1, "must be >= 0, got -1"),
        ("affinity", "key", "user", "unknown key"),
    ],
)
def test_limit_and_affinity_rules(section, key, value, problem):
    assert one_problem({**EXTERNAL, section: {key: value}}) == (
        f"models.yaml: models[0].{section}.{key}: {problem}"
    )


def test_unknown_model_keys_are_errors():
    assert one_problem({**EXTERNAL, "replica": 2}) == "models.yaml: models[0].replica: unknown key"


def test_the_only_local_engine_may_spin_wait(model_file):
    alone = parsed(document([local(), EXTERNAL]), model_file.parent).models
    assert [m.spin_wait for m in alone] == [True, False]
    two = parsed(document([local(replicas=2)]), model_file.parent).models
    assert not two[0].spin_wait
    pair = parsed(document([local(), local(name="l2")]), model_file.parent).models
    assert [m.spin_wait for m in pair] == [False, False]


def test_gpu_fraction_sum_and_sizes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    doc = {
        "models": [
            {"name": "a", "source": "m.gguf", "replicas": 2, "gpu_memory_fraction": 0.4},
            {
                "name": "b",
                "source": "m.gguf",
                "gpu_memory_fraction": 0.2,
                "kv_cache_memory": "lots",
            },
        ]
    }
    found = "\n".join(problems(tmp_path, doc))
    assert "sums to 1.00" in found
    assert "models[1].kv_cache_memory: invalid size 'lots'" in found


def test_gpu_fractions_on_cpu_do_not_count(model_file):
    models = [local(replicas=2, gpu_memory_fraction=0.6, device="cpu"), local(name="l2")]
    assert parsed(document(models), model_file.parent).models[0].gpu_share == 0.0
    assert problems_of(
        document([local(replicas=2, gpu_memory_fraction=0.6)]), model_file.parent
    ) == [
        "models.yaml: models: gpu_memory_fraction x replicas of the pinned models sums to 1.20 "
        "on the GPU; it must be <= 0.95"
    ]
