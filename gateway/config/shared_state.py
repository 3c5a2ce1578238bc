"""The ``gateway.state`` section: the Redis where several gateways keep the rate limits they share,
and what decides while it does not answer. Problems never quote the URL: it may hold a secret."""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.config.reader import Reader
from gateway.config.schema import ON_ERROR_POLICIES, SharedState


def read_state(gateway: Reader) -> SharedState | None:
    """The section under ``gateway``; None without one (every limit is the gateway's own)."""
    if not gateway.has("state"):
        return None
    r = gateway.section("state")
    d = SharedState(redis_url="")
    url = r.string("redis_url")
    if url is None and not r.has("redis_url"):
        r.error("redis_url", "is required (redis://HOST:PORT/DB or rediss://...)")
    elif url is not None and (problem := _url_problem(url)):
        r.error("redis_url", problem)
    env, password = r.env_secret("password_env", required=False)
    on_error = r.string("on_error", d.on_error, choices=ON_ERROR_POLICIES) or d.on_error
    gateways = r.integer("gateways", d.gateways)
    if on_error == "local" and not r.has("gateways"):
        r.error(
            "gateways",
            "is required with on_error: local (how many gateways share these limits: each one "
            "grants 1/gateways of every allowance while Redis does not answer)",
        )
    state = SharedState(
        redis_url=url or "",
        password_env=env,
        password=password,
        key_prefix=r.string("key_prefix", d.key_prefix) or d.key_prefix,
        on_error=on_error,
        gateways=gateways,
        # At least 1: a value meant as seconds would time every call out.
        timeout_ms=r.number("timeout_ms", d.timeout_ms, minimum=1, maximum=10_000),
    )
    r.finish()
    return state


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return f"must be a redis:// or rediss:// URL, not {parts.scheme or 'schemeless'}"
    if parts.password is not None:
        return "must not hold a password: name the environment variable that does in password_env"
    if parts.query or parts.fragment:
        return "must have no query string or fragment: timeout_ms sets the timeouts"
    if not parts.hostname:
        return "names no host"
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number from 0 to 65535
    except ValueError:
        return "has an invalid port"
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        return "may only have a database number as its path, like /0"
    return None
