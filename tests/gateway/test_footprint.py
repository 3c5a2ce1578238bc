"""One replica's footprint (gateway/residency/footprint.py): what an engine's /status says it takes
awake (its RSS, its activation peak and its compile workers running now) and parked (its RSS),
and apart from those what structured outputs may still add (the headroom the engine reckons, less
the workers it already counts), with the fields older engines lack counted 0; and the estimate
before the first measurement, structured outputs' memory as its growth."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.residency.footprint import (
    COMPILE_WORKER_ESTIMATE,
    ENGINE_KV_DEFAULT,
    ENGINE_STRUCTURED_CACHE_DEFAULT,
    GGUF_EXPANSION,
    RUNTIME_BYTES,
    estimate,
    measured_bytes,
    measured_growth,
    parked_estimate,
)

MiB = 2**20
AWAKE = {
    "rss_bytes": 1000 * MiB,
    "activation_bytes": 50 * MiB,
    "structured_cache_bytes": 100 * MiB,  # inside rss_bytes: told, not added
    "structured_cache_budget_bytes": 256 * MiB,
    "compile_workers_rss_bytes": 80 * MiB,  # inside the headroom
    "structured_headroom_bytes": 284 * MiB,
}


def test_awake_counts_rss_activations_and_the_running_workers():
    assert measured_bytes({"memory": AWAKE}, awake=True) == (1000 + 50 + 80) * MiB


def test_the_growth_is_the_headroom_less_the_running_workers():
    assert measured_growth({"memory": AWAKE}) == (284 - 80) * MiB
    assert measured_growth({"memory": {**AWAKE, "compile_workers_rss_bytes": 300 * MiB}}) == 0


def test_the_parked_floor_is_estimated_as_what_a_park_does_not_release():
    memory = {"pss_bytes": 900, "rss_bytes": 1200, "weights_bytes": 300, "kv_cache_bytes": 400}
    assert parked_estimate({"memory": memory}) == 200
    assert parked_estimate({"memory": {"rss_bytes": 1200}}) is None  # an older engine
    assert parked_estimate({"memory": {**memory, "weights_bytes": 2000}}) == 0


def test_weights_shared_with_other_engines_count_at_their_share_of_the_pss():
    """An engine whose packed weights are a file that three engines map holds a third of them
    in its PSS, and a park releases that third: what stays is its memory less that share."""
    memory = {"pss_bytes": 900, "rss_bytes": 1500, "weights_bytes": 600, "kv_cache_bytes": 400}
    assert parked_estimate({"memory": memory}) == 0  # the whole weights: too little left
    shared = {**memory, "weights_pss_bytes": 200}
    assert parked_estimate({"memory": shared}) == 300
    rss_only = {**shared, "pss_bytes": None}  # no PSS to take a share of: RSS, whole weights
    assert parked_estimate({"memory": rss_only}) == 500


def test_parked_counts_the_rss_alone():
    assert measured_bytes({"memory": AWAKE}, awake=False) == 1000 * MiB


@pytest.mark.parametrize(
    ("missing", "expected_mib"),
    [("compile_workers_rss_bytes", 1000 + 50), ("activation_bytes", 1000 + 80)],
)
def test_a_field_an_older_engine_lacks_counts_zero(missing, expected_mib):
    memory = {k: v for k, v in AWAKE.items() if k != missing}
    assert measured_bytes({"memory": memory}, awake=True) == expected_mib * MiB
    assert measured_growth({"memory": {}}) == 0


@pytest.mark.parametrize("bad", [None, "1", True, -5, 1.5])
def test_a_field_that_is_no_byte_count_counts_zero(bad):
    memory = {**AWAKE, "activation_bytes": bad, "structured_headroom_bytes": bad}
    assert measured_bytes({"memory": memory}, awake=True) == (1000 + 80) * MiB
    assert measured_growth({"memory": memory}) == 0


@pytest.mark.parametrize("status", [None, {}, {"memory": {}}, {"memory": {"rss_bytes": 0}}])
def test_no_rss_no_measurement(status):
    assert measured_bytes(status, awake=True) is None


def local_model(tmp_path, **keys):
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"x" * 1000)
    config = parse_config({"models": [{"name": "m", "source": str(source), **keys}]})
    return config.models[0]


@pytest.mark.parametrize(
    ("engine_args", "cache"),
    [
        ([], ENGINE_STRUCTURED_CACHE_DEFAULT),
        (["--structured-cache-memory", "64MiB"], 64 * MiB),
        (["--num-threads", "2", "--structured-cache-memory=1GiB"], 2**30),
        (["--structured-cache-memory", "lots"], ENGINE_STRUCTURED_CACHE_DEFAULT),
    ],
)
def test_the_estimate_counts_the_structured_cache_budget(tmp_path, engine_args, cache):
    model = local_model(tmp_path, device="cpu", engine_args=engine_args)
    footprint = estimate(model)
    assert footprint.awake_bytes == RUNTIME_BYTES + GGUF_EXPANSION * 1000 + ENGINE_KV_DEFAULT
    assert footprint.growth_bytes == cache + COMPILE_WORKER_ESTIMATE
    assert footprint.parked_bytes == RUNTIME_BYTES and not footprint.measured


def test_a_memory_estimate_is_taken_as_it_is(tmp_path):
    model = local_model(tmp_path, memory_estimate="3GiB")
    assert estimate(model).awake_bytes == 3 * 2**30
