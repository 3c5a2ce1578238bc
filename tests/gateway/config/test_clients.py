"""What a client may send and hold: ``gateway.clients`` (deadlines and connection caps),
``max_body_bytes``, ``max_header_bytes``; and the gateway's switches ``access_log``,
``watch_config`` and ``engine_template``."""

from __future__ import annotations

import pytest

from common.http_server import ClientLimits
from tests.gateway.config.documents import document, gateway_doc, parsed, problems_of


def test_absent_settings_are_the_defaults():
    settings = parsed(document()).gateway
    assert settings.clients == ClientLimits()
    assert (settings.max_body_bytes, settings.max_header_bytes) == (4 * 2**20, 8190)
    assert settings.access_log and settings.watch_config and settings.engine_template


def test_given_values_are_read():
    clients = {
        "header_timeout_s": 1,
        "body_timeout_s": 2,
        "idle_timeout_s": 3,
        "max_connections": 4,
        "max_connections_per_address": 1,
    }
    settings = parsed(
        gateway_doc(
            clients=clients,
            max_body_bytes="1MiB",
            max_header_bytes=1024,
            access_log=False,
            watch_config=False,
            engine_template=False,
        )
    ).gateway
    assert settings.clients == ClientLimits(1, 2, 3, 4, 1)
    assert (settings.max_body_bytes, settings.max_header_bytes) == (2**20, 1024)
    assert not settings.access_log and not settings.watch_config and not settings.engine_template


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("header_timeout_s", 0, "must be > 0, got 0"),
        ("body_timeout_s", -1, "must be > 0, got -1"),
        ("idle_timeout_s", "15", "must be a number, got '15'"),
        ("max_connections", 0, "must be >= 1, got 0"),
        ("max_connections_per_address", 2.5, "must be an integer, got 2.5"),
        ("max_conns", 1, "unknown key"),
    ],
)
def test_client_rules(key, value, problem):
    assert problems_of(gateway_doc(clients={key: value})) == [
        f"models.yaml: gateway.clients.{key}: {problem}"
    ]


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("max_body_bytes", "big", "invalid size 'big': expected e.g. 512MiB, 2GiB or a byte count"),
        ("max_body_bytes", 0, "must be positive"),
        ("max_header_bytes", 1023, "must be >= 1024, got 1023"),
        ("access_log", "no", "must be true or false, got 'no'"),
        ("watch_config", 1, "must be true or false, got 1"),
        ("engine_template", "off", "must be true or false, got 'off'"),
    ],
)
def test_limit_and_switch_rules(key, value, problem):
    assert problems_of(gateway_doc(**{key: value})) == [f"models.yaml: gateway.{key}: {problem}"]
