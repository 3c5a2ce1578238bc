"""``gateway.timeouts`` and a model's own ``timeouts``, which override the gateway's key by key."""

from __future__ import annotations

import pytest

from gateway.config import Timeouts
from tests.gateway.config.documents import EXTERNAL, document, gateway_doc, parsed, problems_of

KEYS = ("connect_s", "first_byte_s", "idle_s", "total_s")


def test_absent_timeouts_are_the_defaults():
    config = parsed(document())
    assert config.gateway.timeouts == Timeouts() == config.models[0].timeouts


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", [0, -1])
def test_timeouts_are_more_than_zero(key, value):
    assert problems_of(gateway_doc(timeouts={key: value})) == [
        f"models.yaml: gateway.timeouts.{key}: must be > 0, got {value}"
    ]


def test_a_models_timeouts_override_the_gateways_key_by_key():
    model = {**EXTERNAL, "timeouts": {"first_byte_s": 120}}
    config = parsed(document([model], gateway={"timeouts": {"connect_s": 1, "first_byte_s": 5}}))
    assert config.gateway.timeouts == Timeouts(connect_s=1, first_byte_s=5)
    assert config.models[0].timeouts == Timeouts(connect_s=1, first_byte_s=120)


def test_a_models_timeouts_follow_the_same_rules():
    model = {**EXTERNAL, "timeouts": {"idle_s": "long", "total": 5}}
    assert problems_of(document([model])) == [
        "models.yaml: models[0].timeouts.idle_s: must be a number, got 'long'",
        "models.yaml: models[0].timeouts.total: unknown key",
    ]
