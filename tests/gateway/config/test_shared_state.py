"""``gateway.state``: the Redis that several gateways share their rate limits through — a test
per rule. No problem quotes the URL, which may hold a secret."""

from __future__ import annotations

import pytest

from gateway.config import SharedState
from tests.gateway.config.documents import document, gateway_doc, parsed, problems_of

URL = "redis://limits.internal:6379/0"


def state_doc(**state):
    return gateway_doc(state=state)


def test_absent_state_keeps_limits_in_process():
    assert parsed(document()).gateway.state is None


def test_the_smallest_state_takes_the_defaults():
    state = parsed(state_doc(redis_url=URL, gateways=2)).gateway.state
    assert state == SharedState(redis_url=URL, gateways=2)
    assert (state.on_error, state.key_prefix, state.timeout_ms) == ("local", "modelyard:", 100.0)


def test_given_values_are_read(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    state = parsed(
        state_doc(
            redis_url="rediss://limiter@limits.internal:6380/2",
            password_env="REDIS_PASSWORD",
            key_prefix="fleet-a:",
            on_error="deny",
            timeout_ms=25,
        )
    ).gateway.state
    assert state == SharedState(
        redis_url="rediss://limiter@limits.internal:6380/2",
        password_env="REDIS_PASSWORD",
        password="s3cret",
        key_prefix="fleet-a:",
        on_error="deny",
        timeout_ms=25.0,
    )
    assert "s3cret" not in repr(state)
    assert state.address == "rediss://limits.internal:6380/2"  # no user info in logs


def test_redis_url_is_required():
    assert problems_of(state_doc(gateways=2)) == [
        "models.yaml: gateway.state.redis_url: is required (redis://HOST:PORT/DB or rediss://...)"
    ]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://limits:6379", "must be a redis:// or rediss:// URL, not http"),
        ("limits:6379", "must be a redis:// or rediss:// URL, not limits"),
        ("redis://limits:6379?socket_timeout=5", "must have no query string or fragment: "
         "timeout_ms sets the timeouts"),
        ("redis:///0", "names no host"),
        ("redis://limits:port/0", "has an invalid port"),
        ("redis://limits:70000", "has an invalid port"),
        ("redis://limits:6379/zero", "may only have a database number as its path, like /0"),
    ],
)  # fmt: skip
def test_redis_url_rules(url, problem):
    assert problems_of(state_doc(redis_url=url, gateways=2)) == [
        f"models.yaml: gateway.state.redis_url: {problem}"
    ]


@pytest.mark.parametrize("url", ["redis://:hunter22@limits:6379", "redis://u:hunter22@limits"])
def test_a_password_in_the_url_is_refused_without_quoting_it(url):
    problems = problems_of(state_doc(redis_url=url, gateways=2))
    assert problems == [
        "models.yaml: gateway.state.redis_url: must not hold a password: name the environment "
        "variable that does in password_env"
    ]
    assert "hunter22" not in problems[0]


def test_password_env_must_be_set(monkeypatch):
    monkeypatch.delenv("NO_SUCH_REDIS_PASSWORD", raising=False)
    doc = state_doc(redis_url=URL, gateways=2, password_env="NO_SUCH_REDIS_PASSWORD")
    assert problems_of(doc) == [
        "models.yaml: gateway.state.password_env: environment variable NO_SUCH_REDIS_PASSWORD "
        "is not set or empty"
    ]


def test_password_env_must_be_a_variable_name():
    assert problems_of(state_doc(redis_url=URL, gateways=2, password_env="not a name")) == [
        "models.yaml: gateway.state.password_env: 'not a name' is not a valid environment "
        "variable name"
    ]


def test_key_prefix_must_be_a_non_empty_string():
    assert problems_of(state_doc(redis_url=URL, gateways=2, key_prefix="")) == [
        "models.yaml: gateway.state.key_prefix: must be a non-empty string, got ''"
    ]


def test_on_error_is_one_of_the_policies():
    assert problems_of(state_doc(redis_url=URL, gateways=2, on_error="retry")) == [
        "models.yaml: gateway.state.on_error: must be one of allow, deny, local, got 'retry'"
    ]


@pytest.mark.parametrize("on_error", [None, "local"])
def test_gateways_is_required_with_the_local_policy(on_error):
    state = {"redis_url": URL} | ({"on_error": on_error} if on_error else {})
    assert problems_of(state_doc(**state)) == [
        "models.yaml: gateway.state.gateways: is required with on_error: local (how many "
        "gateways share these limits: each one grants 1/gateways of every allowance while Redis "
        "does not answer)"
    ]


@pytest.mark.parametrize("on_error", ["allow", "deny"])
def test_gateways_is_optional_with_the_other_policies(on_error):
    assert parsed(state_doc(redis_url=URL, on_error=on_error)).gateway.state.gateways == 1


@pytest.mark.parametrize(("value", "problem"), [(0, "must be >= 1, got 0"),
                                                (1.5, "must be an integer, got 1.5")])  # fmt: skip
def test_gateways_is_a_positive_integer(value, problem):
    assert problems_of(state_doc(redis_url=URL, gateways=value)) == [
        f"models.yaml: gateway.state.gateways: {problem}"
    ]


@pytest.mark.parametrize("value", [0, 0.5, 10_001])
def test_timeout_ms_is_from_1_to_10000(value):
    assert problems_of(state_doc(redis_url=URL, gateways=2, timeout_ms=value)) == [
        f"models.yaml: gateway.state.timeout_ms: must be >= 1 and <= 10000, got {value!r}"
    ]


def test_unknown_keys_are_errors():
    assert problems_of(state_doc(redis_url=URL, gateways=2, url=URL)) == [
        "models.yaml: gateway.state.url: unknown key"
    ]


def test_state_must_be_a_mapping():
    assert problems_of(gateway_doc(state=URL)) == [
        "models.yaml: gateway.state: must be a mapping, got str",
        "models.yaml: gateway.state.redis_url: is required (redis://HOST:PORT/DB or rediss://...)",
        "models.yaml: gateway.state.gateways: is required with on_error: local (how many "
        "gateways share these limits: each one grants 1/gateways of every allowance while Redis "
        "does not answer)",
    ]
