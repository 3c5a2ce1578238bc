"""``gateway.listen`` and ``gateway.auth``: the address, open mode's loopback rule, API keys and
the admin key; and ``--host``/``--port`` (with_listen)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, with_listen
from tests.gateway.config.documents import (
    EXTERNAL,
    document,
    gateway_doc,
    parsed,
    problems,
    problems_of,
)

KEYS = {"A_KEY": "sk-a", "B_KEY": "sk-b", "ADMIN_KEY": "sk-admin"}


@pytest.fixture
def keys(monkeypatch):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)


def auth_doc(**auth):
    return gateway_doc(auth=auth)


@pytest.mark.parametrize("listen", ["[::1]:8080", "localhost:1", "127.0.0.2:65535"])
def test_listen_takes_a_loopback_host_and_port(listen):
    settings = parsed(gateway_doc(listen=listen)).gateway
    host, port = listen.rsplit(":", 1)
    assert (settings.host, settings.port) == (host.strip("[]"), int(port))


@pytest.mark.parametrize("listen", ["8000", "host:", ":8000", "h:0", "h:65536", "h:http"])
def test_listen_must_be_host_port(listen):
    assert problems_of(gateway_doc(listen=listen)) == [
        f"models.yaml: gateway.listen: must be HOST:PORT, got {listen!r}"
    ]


def test_open_mode_must_bind_loopback(tmp_path):
    doc = {
        "gateway": {"listen": "0.0.0.0:8000"},
        "models": [{"name": "a", "upstreams": ["http://h:1"]}],
    }
    assert any("open mode" in p and "gateway.listen" in p for p in problems(tmp_path, doc))


def test_open_mode_names_the_host_it_refuses():
    assert problems_of(gateway_doc(listen="0.0.0.0:8000")) == [
        "models.yaml: gateway.listen: no API keys are configured (open mode), so the gateway may "
        "only bind a loopback address, not '0.0.0.0'; add auth.keys or listen on 127.0.0.1"
    ]


def test_with_keys_any_address_may_be_bound(keys):
    settings = parsed(
        gateway_doc(listen="0.0.0.0:80", auth={"keys": [{"name": "a", "key_env": "A_KEY"}]})
    ).gateway
    assert (settings.host, settings.port) == ("0.0.0.0", 80)


def test_command_line_overrides_keep_open_mode_on_loopback():
    config = parsed(document())
    assert (with_listen(config, None, 9000).gateway.port, config.gateway.port) == (9000, 8000)
    assert with_listen(config, "localhost", None).gateway.host == "localhost"
    with pytest.raises(ConfigError) as info:
        with_listen(config, "0.0.0.0", None)
    assert info.value.problems == [
        "models.yaml: --host 0.0.0.0: open mode (no API keys) only binds loopback addresses"
    ]


def test_keys_read_with_their_secrets_models_and_limits(keys):
    auth = parsed(
        auth_doc(
            admin_key_env="ADMIN_KEY",
            keys=[
                {"name": "a", "key_env": "A_KEY", "models": ["x"], "rpm": 60, "tpm": 1000},
                {"name": "b", "key_env": "B_KEY", "models": ["*"]},
            ],
        )
    ).gateway.auth
    a, b = auth.keys
    assert (a.name, a.secret, a.models, a.rpm, a.tpm) == ("a", "sk-a", ("x",), 60, 1000)
    assert (b.models, b.rpm, b.tpm) == (None, None, None)  # "*": every model
    assert auth.admin_key == "sk-admin" and not auth.open_mode


def test_keys_must_be_a_list():
    assert problems_of(auth_doc(keys={"name": "a"})) == [
        "models.yaml: gateway.auth.keys: must be a list"
    ]


def test_a_key_needs_a_name(keys):
    assert problems_of(auth_doc(keys=[{"key_env": "A_KEY"}])) == [
        "models.yaml: gateway.auth.keys[0].name: is required"
    ]


def test_key_names_are_unique(keys):
    found = problems_of(
        auth_doc(keys=[{"name": "a", "key_env": "A_KEY"}, {"name": "a", "key_env": "B_KEY"}])
    )
    assert found == ["models.yaml: gateway.auth.keys[1].name: duplicate key name 'a'"]


def test_a_key_needs_its_variable(keys):
    assert problems_of(auth_doc(keys=[{"name": "a"}])) == [
        "models.yaml: gateway.auth.keys[0].key_env: is required (the name of an environment "
        "variable)"
    ]


def test_a_key_whose_variable_is_unset_still_ends_open_mode(monkeypatch):
    monkeypatch.delenv("UNSET_KEY", raising=False)
    found = problems_of(
        gateway_doc(listen="0.0.0.0:80", auth={"keys": [{"name": "a", "key_env": "UNSET_KEY"}]})
    )
    assert found == [
        "models.yaml: gateway.auth.keys[0].key_env: environment variable UNSET_KEY is not set or "
        "empty"
    ]


def test_two_keys_may_not_share_a_secret(monkeypatch, keys):
    monkeypatch.setenv("SAME_KEY", KEYS["A_KEY"])
    found = problems_of(
        auth_doc(keys=[{"name": "a", "key_env": "A_KEY"}, {"name": "b", "key_env": "SAME_KEY"}])
    )
    assert found == ["models.yaml: gateway.auth.keys: two keys have the same secret value"]


def test_the_admin_key_differs_from_every_client_key(monkeypatch, keys):
    monkeypatch.setenv("ADMIN_KEY", KEYS["A_KEY"])
    found = problems_of(
        auth_doc(admin_key_env="ADMIN_KEY", keys=[{"name": "a", "key_env": "A_KEY"}])
    )
    assert found == [
        "models.yaml: gateway.auth.admin_key_env: the admin key must differ from every client key"
    ]


def test_the_admin_keys_variable_may_be_unset(monkeypatch):
    monkeypatch.delenv("UNSET_ADMIN_KEY", raising=False)
    auth = parsed(auth_doc(admin_key_env="UNSET_ADMIN_KEY")).gateway.auth
    assert (auth.admin_key_env, auth.admin_key) == ("UNSET_ADMIN_KEY", None)


def test_a_keys_models_must_be_served(keys):
    found = problems_of(auth_doc(keys=[{"name": "a", "key_env": "A_KEY", "models": ["x", "y"]}]))
    assert found == ["models.yaml: gateway.auth.keys[0].models: unknown model 'y'"]


def test_a_keys_models_may_name_aliases(keys):
    aliased = {**EXTERNAL, "aliases": ["alias"]}
    config = parsed(
        document(
            [aliased],
            gateway={"auth": {"keys": [{"name": "a", "key_env": "A_KEY", "models": ["alias"]}]}},
        )
    )
    assert config.gateway.auth.keys[0].models == ("alias",)


@pytest.mark.parametrize("limit", ["rpm", "tpm"])
def test_key_limits_are_positive_integers(keys, limit):
    found = problems_of(auth_doc(keys=[{"name": "a", "key_env": "A_KEY", limit: 0}]))
    assert found == [f"models.yaml: gateway.auth.keys[0].{limit}: must be >= 1, got 0"]


def test_unknown_auth_keys_are_errors(keys):
    found = problems_of(
        auth_doc(keys=[{"name": "a", "key_env": "A_KEY", "model": ["x"]}], admin="x")
    )
    assert found == [
        "models.yaml: gateway.auth.keys[0].model: unknown key",
        "models.yaml: gateway.auth.admin: unknown key",
    ]
