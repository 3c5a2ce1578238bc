"""The ``gateway`` section: listen address, timeouts, health checks, ejection, retries, limits on
clients and bodies, the switches (access log, config watch, engine template), the engines' log
files, API keys and the admission policy. Defaults come from the dataclasses in schema.py."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

from common.http_server import ClientLimits
from gateway.config.admission import read_gateway_admission, read_key_admission
from gateway.config.engine_logs import read_engine_logs
from gateway.config.reader import ConfigError, Reader
from gateway.config.residency import read_memory
from gateway.config.schema import (
    ApiKey,
    AuthSettings,
    EjectionSettings,
    FleetConfig,
    GatewaySettings,
    HealthSettings,
    RetrySettings,
    Timeouts,
)
from gateway.config.shared_state import read_state


def read_gateway(r: Reader, base_dir: Path) -> GatewaySettings:
    """``base_dir``: the file's folder, which relative paths start from."""
    d = GatewaySettings()
    host, port = _read_listen(r, d)
    settings = GatewaySettings(
        host=host,
        port=port,
        timeouts=read_timeouts(r.section("timeouts"), d.timeouts),
        health=_read_health(r.section("health")),
        ejection=_read_ejection(r.section("ejection")),
        retries=_read_retries(r.section("retries")),
        max_body_bytes=r.size("max_body_bytes", d.max_body_bytes),
        max_header_bytes=r.integer("max_header_bytes", d.max_header_bytes, minimum=1024),
        clients=_read_clients(r.section("clients")),
        access_log=r.boolean("access_log", d.access_log),
        watch_config=r.boolean("watch_config", d.watch_config),
        engine_template=r.boolean("engine_template", d.engine_template),
        engine_logs=read_engine_logs(r.section("engine_logs"), base_dir),
        auth=_read_auth(r.section("auth")),
        memory=read_memory(r.section("memory")),
        state=read_state(r),
        admission=read_gateway_admission(r.section("admission")),
    )
    if settings.auth.open_mode and not is_loopback(host):
        r.error(
            "listen",
            f"no API keys are configured (open mode), so the gateway may only bind a "
            f"loopback address, not {host!r}; add auth.keys or listen on 127.0.0.1",
        )
    r.finish()
    return settings


def read_timeouts(r: Reader, base: Timeouts) -> Timeouts:
    """The gateway's ``timeouts`` over the defaults, or a model's over the gateway's."""
    timeouts = Timeouts(
        connect_s=r.duration("connect_s", base.connect_s),
        first_byte_s=r.duration("first_byte_s", base.first_byte_s),
        idle_s=r.duration("idle_s", base.idle_s),
        total_s=r.duration("total_s", base.total_s),
    )
    r.finish()
    return timeouts


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_listen(config: FleetConfig, host: str | None, port: int | None) -> FleetConfig:
    """Command-line overrides of the listen address."""
    gateway = replace(
        config.gateway,
        host=host or config.gateway.host,
        port=port if port is not None else config.gateway.port,
    )
    if gateway.auth.open_mode and not is_loopback(gateway.host):
        raise ConfigError(
            [
                f"{config.path}: --host {gateway.host}: open mode (no API keys) only "
                "binds loopback addresses"
            ]
        )
    return replace(config, gateway=gateway)


def _read_listen(r: Reader, d: GatewaySettings) -> tuple[str, int]:
    listen = r.string("listen", f"{d.host}:{d.port}")
    assert listen is not None
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        r.error("listen", f"must be HOST:PORT, got {listen!r}")
        return d.host, d.port
    return host, int(port)


def _read_health(r: Reader) -> HealthSettings:
    d = HealthSettings()
    health = HealthSettings(
        interval_s=r.number("interval_s", d.interval_s, minimum=0.05),
        timeout_s=r.duration("timeout_s", d.timeout_s),
        unhealthy_after=r.integer("unhealthy_after", d.unhealthy_after),
        healthy_after=r.integer("healthy_after", d.healthy_after),
    )
    r.finish()
    return health


def _read_ejection(r: Reader) -> EjectionSettings:
    d = EjectionSettings()
    ejection = EjectionSettings(
        consecutive_failures=r.integer("consecutive_failures", d.consecutive_failures),
        base_s=r.duration("base_s", d.base_s),
        max_s=r.duration("max_s", d.max_s),
        max_percent=r.number("max_percent", d.max_percent, minimum=0, maximum=100),
    )
    r.finish()
    return ejection


def _read_retries(r: Reader) -> RetrySettings:
    d = RetrySettings()
    retries = RetrySettings(
        attempts=r.integer("attempts", d.attempts, maximum=10),
        backoff_ms=r.number("backoff_ms", d.backoff_ms, minimum=0),
        budget_percent=r.number("budget_percent", d.budget_percent, minimum=0, maximum=100),
        budget_min=r.integer("budget_min", d.budget_min, minimum=0),
    )
    r.finish()
    return retries


def _read_clients(r: Reader) -> ClientLimits:
    d = ClientLimits()
    limits = ClientLimits(
        header_timeout_s=r.duration("header_timeout_s", d.header_timeout_s),
        body_timeout_s=r.duration("body_timeout_s", d.body_timeout_s),
        idle_timeout_s=r.duration("idle_timeout_s", d.idle_timeout_s),
        max_connections=r.integer("max_connections", d.max_connections),
        max_connections_per_address=r.integer(
            "max_connections_per_address", d.max_connections_per_address
        ),
    )
    r.finish()
    return limits


def _read_auth(r: Reader) -> AuthSettings:
    admin_env, admin_key = None, None
    if r.has("admin_key_env"):
        # Unset is allowed: admin endpoints are then off (or loopback-open in open mode).
        admin_env, admin_key = r.env_secret("admin_key_env", required=False, must_be_set=False)
    keys: list[ApiKey] = []
    raw_keys = r.raw("keys")
    if raw_keys is not None and not isinstance(raw_keys, list):
        r.error("keys", "must be a list")
        raw_keys = []
    names: set[str] = set()
    for i, item in enumerate(raw_keys or []):
        keys.append(_read_key(r.item("keys", i, item), names))
    secrets = [k.secret for k in keys if k.secret]
    if len(set(secrets)) != len(secrets):
        r.error("keys", "two keys have the same secret value")
    if admin_key and admin_key in secrets:
        r.error("admin_key_env", "the admin key must differ from every client key")
    r.finish()
    return AuthSettings(admin_key_env=admin_env, admin_key=admin_key, keys=tuple(keys))


def _read_key(k: Reader, names: set[str]) -> ApiKey:
    """One of ``auth.keys``. Kept even when its secret is missing (already reported), so that the
    checks after it see the key: it is not open mode, and its model list still gets validated."""
    name = k.string("name")
    if name is None:
        k.error("name", "is required")
    elif name in names:
        k.error("name", f"duplicate key name {name!r}")
    names.add(name or "")
    env, secret = k.env_secret("key_env", required=True)
    models = k.string_list("models") if k.has("models") else None
    if models is not None and "*" in models:
        models = None
    rpm = k.integer("rpm", None)
    tpm = k.integer("tpm", None)
    admission = read_key_admission(k)
    k.finish()
    return ApiKey(
        name=name or "",
        key_env=env or "",
        secret=secret or "",
        models=models,
        rpm=rpm,
        tpm=tpm,
        **admission,
    )
