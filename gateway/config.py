"""models.yaml: loading and validation into typed, immutable configuration.

Every problem is collected (not just the first) and reported as ``file: key.path: problem`` so that
``modelyard check`` can list them all and a reload can refuse a bad edit with a precise reason.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from common.http_server import ClientLimits
from common.sizes import parse_size

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_GPU_FRACTION_SUM = 0.95


class ConfigError(Exception):
    """One or more problems in a models.yaml; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_byte_s: float = 60.0  # to the response headers; for streams, to the first chunk
    idle_s: float = 30.0  # between stream chunks (and while reading a response body)
    total_s: float = 600.0


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1


@dataclass(frozen=True)
class EjectionSettings:
    consecutive_failures: int = 3
    base_s: float = 5.0
    max_s: float = 300.0
    max_percent: float = 50.0


@dataclass(frozen=True)
class RetrySettings:
    attempts: int = 2  # total tries, the first included
    backoff_ms: float = 50.0
    budget_percent: float = 20.0  # retries may add at most this share of requests...
    budget_min: int = 10  # ...plus this reserve, so a quiet gateway can still retry


@dataclass(frozen=True)
class ApiKey:
    name: str
    key_env: str
    secret: str = field(repr=False)
    models: tuple[str, ...] | None  # None: every model
    rpm: int | None = None
    tpm: int | None = None


@dataclass(frozen=True)
class AuthSettings:
    admin_key_env: str | None = None
    admin_key: str | None = field(default=None, repr=False)
    keys: tuple[ApiKey, ...] = ()

    @property
    def open_mode(self) -> bool:
        return not self.keys


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    timeouts: Timeouts = Timeouts()
    health: HealthSettings = HealthSettings()
    ejection: EjectionSettings = EjectionSettings()
    retries: RetrySettings = RetrySettings()
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 8190
    clients: ClientLimits = field(default_factory=ClientLimits)
    access_log: bool = True
    watch_config: bool = True  # reload when models.yaml changes on disk
    auth: AuthSettings = AuthSettings()


@dataclass(frozen=True)
class ModelLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Affinity:
    by: str = "none"  # none | prefix | user
    prefix_chars: int = 256
    max_extra_load: int = 4  # leave the warm replica when it has this many more requests in flight


@dataclass(frozen=True)
class ModelConfig:
    name: str
    aliases: tuple[str, ...] = ()
    upstreams: tuple[str, ...] = ()  # external OpenAI-compatible servers: routed, never spawned
    source: str | None = None  # local model file or folder: the pool spawns engines for it
    upstream_model: str | None = None  # the name the upstream knows the model by
    api_key_env: str | None = None
    api_key: str | None = field(default=None, repr=False)
    health_path: str = "/ready"
    replicas: int = 1
    device: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    gpu_memory_fraction: float | None = None
    kv_cache_memory: int | None = None
    engine_args: tuple[str, ...] = ()  # extra `python -m engine` flags
    # Derived, not configured: the fleet's only local engine may let idle threads spin briefly
    # (engine.openmp_env); with several, they would take each other's cores. The pool reads it
    # at each engine start; it never makes the pool replace a running engine.
    spin_wait: bool = False
    limits: ModelLimits = ModelLimits()
    timeouts: Timeouts = Timeouts()
    affinity: Affinity = Affinity()

    @property
    def local(self) -> bool:
        return self.source is not None

    @property
    def wire_name(self) -> str:
        """The model name requests carry upstream."""
        return self.upstream_model or self.name


@dataclass(frozen=True)
class FleetConfig:
    path: str
    gateway: GatewaySettings
    models: tuple[ModelConfig, ...]

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


class _Reader:
    """Walks a YAML mapping, converting values and collecting every problem with its key path."""

    def __init__(self, data: Any, path: str, problems: list[str], file: str) -> None:
        self.path = path
        self.problems = problems
        self.file = file
        self.seen: set[str] = set()
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.error(None, f"must be a mapping, got {type(data).__name__}")
            data = {}
        self.data = data

    def key_path(self, key: str | None) -> str:
        if key is None:
            return self.path or "(top level)"
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | None, problem: str) -> None:
        self.problems.append(f"{self.file}: {self.key_path(key)}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        self.seen.add(key)
        return self.data.get(key)

    def section(self, key: str) -> _Reader:
        return _Reader(self.raw(key), self.key_path(key), self.problems, self.file)

    def number(
        self,
        key: str,
        default: Any,
        *,
        kind: type = float,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_min: bool = False,
    ) -> Any:
        value = self.raw(key)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            self.error(key, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            return default
        too_low = minimum is not None and (value <= minimum if exclusive_min else value < minimum)
        if too_low or (maximum is not None and value > maximum):
            low = f"> {minimum}" if exclusive_min else f">= {minimum}"
            bounds = " and ".join(
                b
                for b in (
                    low if minimum is not None else "",
                    f"<= {maximum}" if maximum is not None else "",
                )
                if b
            )
            self.error(key, f"must be {bounds}, got {value!r}")
            return default
        return kind(value)

    def string(
        self, key: str, default: str | None = None, *, choices: tuple[str, ...] | None = None
    ) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            self.error(key, f"must be a non-empty string, got {value!r}")
            return default
        if choices and value not in choices:
            self.error(key, f"must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.error(key, f"must be true or false, got {value!r}")
            return default
        return value

    def string_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.error(key, f"must be a list of non-empty strings, got {value!r}")
            return ()
        return tuple(value)

    def size(self, key: str) -> int | None:
        value = self.raw(key)
        if value is None:
            return None
        try:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"invalid size {value!r}: expected e.g. 512MiB or a byte count")
            size = parse_size(value)
        except ValueError as exc:
            self.error(key, str(exc))
            return None
        if size <= 0:
            self.error(key, "must be positive")
            return None
        return size

    def env_secret(
        self, key: str, required: bool, must_be_set: bool = True
    ) -> tuple[str | None, str | None]:
        """Reads the name of an environment variable and that variable's value."""
        env = self.string(key)
        if env is None:
            if required:
                self.error(key, "is required (the name of an environment variable)")
            return None, None
        if not _ENV_RE.match(env):
            self.error(key, f"{env!r} is not a valid environment variable name")
            return None, None
        secret = os.environ.get(env)
        if not secret and must_be_set:
            self.error(key, f"environment variable {env} is not set or empty")
            return env, None
        return env, secret

    def finish(self) -> None:
        for key in self.data:
            if key not in self.seen:
                self.error(str(key), "unknown key")


def _read_timeouts(r: _Reader, base: Timeouts) -> Timeouts:
    t = Timeouts(
        connect_s=r.number("connect_s", base.connect_s, minimum=0, exclusive_min=True),
        first_byte_s=r.number("first_byte_s", base.first_byte_s, minimum=0, exclusive_min=True),
        idle_s=r.number("idle_s", base.idle_s, minimum=0, exclusive_min=True),
        total_s=r.number("total_s", base.total_s, minimum=0, exclusive_min=True),
    )
    r.finish()
    return t


def _read_clients(r: _Reader) -> ClientLimits:
    d = ClientLimits()

    def seconds(key: str, default: float) -> float:
        return r.number(key, default, minimum=0, exclusive_min=True)

    def count(key: str, default: int) -> int:
        return r.number(key, default, kind=int, minimum=1)

    limits = ClientLimits(
        header_timeout_s=seconds("header_timeout_s", d.header_timeout_s),
        body_timeout_s=seconds("body_timeout_s", d.body_timeout_s),
        idle_timeout_s=seconds("idle_timeout_s", d.idle_timeout_s),
        max_connections=count("max_connections", d.max_connections),
        max_connections_per_address=count(
            "max_connections_per_address", d.max_connections_per_address
        ),
    )
    r.finish()
    return limits


def _read_listen(r: _Reader) -> tuple[str, int]:
    listen = r.string("listen", "127.0.0.1:8000")
    assert listen is not None
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        r.error("listen", f"must be HOST:PORT, got {listen!r}")
        return "127.0.0.1", 8000
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_auth(r: _Reader) -> AuthSettings:
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
        k = _Reader(item, f"{r.key_path('keys')}[{i}]", r.problems, r.file)
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
        rpm = k.number("rpm", None, kind=int, minimum=1)
        tpm = k.number("tpm", None, kind=int, minimum=1)
        k.finish()
        # Kept even when its secret is missing (already reported), so that the checks below
        # see the key: it is not open mode, and its model list still gets validated.
        keys.append(
            ApiKey(
                name=name or "",
                key_env=env or "",
                secret=secret or "",
                models=models,
                rpm=rpm,
                tpm=tpm,
            )
        )
    secrets = [k.secret for k in keys if k.secret]
    if len(set(secrets)) != len(secrets):
        r.error("keys", "two keys have the same secret value")
    if admin_key and admin_key in secrets:
        r.error("admin_key_env", "the admin key must differ from every client key")
    r.finish()
    return AuthSettings(admin_key_env=admin_env, admin_key=admin_key, keys=tuple(keys))


def _read_gateway(r: _Reader) -> GatewaySettings:
    host, port = _read_listen(r)
    timeouts = _read_timeouts(r.section("timeouts"), Timeouts())
    h, hd = r.section("health"), HealthSettings()
    health = HealthSettings(
        interval_s=h.number("interval_s", hd.interval_s, minimum=0.05),
        timeout_s=h.number("timeout_s", hd.timeout_s, minimum=0, exclusive_min=True),
        unhealthy_after=h.number("unhealthy_after", hd.unhealthy_after, kind=int, minimum=1),
        healthy_after=h.number("healthy_after", hd.healthy_after, kind=int, minimum=1),
    )
    h.finish()
    e, ed = r.section("ejection"), EjectionSettings()
    ejection = EjectionSettings(
        consecutive_failures=e.number(
            "consecutive_failures", ed.consecutive_failures, kind=int, minimum=1
        ),
        base_s=e.number("base_s", ed.base_s, minimum=0, exclusive_min=True),
        max_s=e.number("max_s", ed.max_s, minimum=0, exclusive_min=True),
        max_percent=e.number("max_percent", ed.max_percent, minimum=0, maximum=100),
    )
    e.finish()
    t, td = r.section("retries"), RetrySettings()
    retries = RetrySettings(
        attempts=t.number("attempts", td.attempts, kind=int, minimum=1, maximum=10),
        backoff_ms=t.number("backoff_ms", td.backoff_ms, minimum=0),
        budget_percent=t.number("budget_percent", td.budget_percent, minimum=0, maximum=100),
        budget_min=t.number("budget_min", td.budget_min, kind=int, minimum=0),
    )
    t.finish()
    settings = GatewaySettings(
        host=host,
        port=port,
        timeouts=timeouts,
        health=health,
        ejection=ejection,
        retries=retries,
        max_body_bytes=r.size("max_body_bytes") or GatewaySettings.max_body_bytes,
        max_header_bytes=r.number(
            "max_header_bytes", GatewaySettings.max_header_bytes, kind=int, minimum=1024
        ),
        clients=_read_clients(r.section("clients")),
        access_log=r.boolean("access_log", True),
        watch_config=r.boolean("watch_config", True),
        auth=_read_auth(r.section("auth")),
    )
    if settings.auth.open_mode and not _is_loopback(host):
        r.error(
            "listen",
            f"no API keys are configured (open mode), so the gateway may only bind a "
            f"loopback address, not {host!r}; add auth.keys or listen on 127.0.0.1",
        )
    r.finish()
    return settings


def _normalise_upstream(url: str, r: _Reader, key: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        r.error(key, f"{url!r} is not an http(s) URL")
        return None
    if parts.query or parts.fragment:
        r.error(key, f"{url!r} must not have a query or fragment")
        return None
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url  # the gateway appends /v1/...


def _read_model(
    r: _Reader, defaults: dict[str, Any], gateway: GatewaySettings, base_dir: Path
) -> ModelConfig | None:
    name = r.string("name")
    if name is None:
        r.error("name", "is required")
    elif not _NAME_RE.match(name):
        r.error("name", f"{name!r} may only contain letters, digits and ._:/@+- (max 128)")
    aliases = r.string_list("aliases")
    for alias in aliases:
        if not _NAME_RE.match(alias):
            r.error("aliases", f"{alias!r} may only contain letters, digits and ._:/@+-")
    upstreams: list[str] = []
    for i, url in enumerate(r.string_list("upstreams")):
        normalised = _normalise_upstream(url, r, f"upstreams[{i}]")
        if normalised:
            upstreams.append(normalised)
    if len(set(upstreams)) != len(upstreams):
        r.error("upstreams", "lists the same URL twice")
    source = r.string("source")
    if source is not None and r.has("upstreams"):
        r.error("source", "a model has either `source` (spawned locally) or `upstreams`, not both")
    elif source is None and not upstreams and not r.has("upstreams"):
        r.error(None, "needs `source` (a local model to spawn) or `upstreams` (URLs to route to)")
    elif r.has("upstreams") and not upstreams and source is None:
        r.error("upstreams", "must list at least one URL")
    if source is not None:
        resolved = Path(source) if Path(source).is_absolute() else base_dir / source
        if not resolved.exists():
            r.error("source", f"{resolved} does not exist")
        source = str(resolved)

    def default(key: str, fallback: Any) -> Any:
        return defaults.get(key, fallback)

    replicas = r.number("replicas", 1, kind=int, minimum=1, maximum=64)
    device = r.string("device", default("device", "auto"), choices=("auto", "cpu", "cuda"))
    fraction = r.number(
        "gpu_memory_fraction",
        default("gpu_memory_fraction", None),
        minimum=0,
        maximum=1,
        exclusive_min=True,
    )
    kv_memory = (
        r.size("kv_cache_memory") if r.has("kv_cache_memory") else default("kv_cache_memory", None)
    )
    local_keys = ("replicas", "device", "gpu_memory_fraction", "kv_cache_memory", "engine_args")
    if source is None:
        for key in local_keys:
            if r.has(key):
                r.error(key, "only applies to local models (with `source`)")
    health_path = r.string("health_path", "/ready")
    if health_path and not health_path.startswith("/"):
        r.error("health_path", f"must start with '/', got {health_path!r}")
    api_key_env, api_key = (None, None)
    if r.has("api_key_env"):
        api_key_env, api_key = r.env_secret("api_key_env", required=False)

    lim = r.section("limits")
    limits = ModelLimits(
        rpm=lim.number("rpm", None, kind=int, minimum=1),
        tpm=lim.number("tpm", None, kind=int, minimum=1),
        max_concurrency=lim.number("max_concurrency", None, kind=int, minimum=1),
    )
    lim.finish()
    a = r.section("affinity")
    affinity = Affinity(
        by=a.string("by", "none", choices=("none", "prefix", "user")) or "none",
        prefix_chars=a.number("prefix_chars", 256, kind=int, minimum=1),
        max_extra_load=a.number("max_extra_load", 4, kind=int, minimum=0),
    )
    a.finish()
    config = ModelConfig(
        name=name or "",
        aliases=aliases,
        upstreams=tuple(upstreams),
        source=source,
        upstream_model=r.string("upstream_model"),
        api_key_env=api_key_env,
        api_key=api_key,
        health_path=health_path or "/ready",
        replicas=replicas if source else len(upstreams),
        device=device or "auto",
        max_model_len=r.number(
            "max_model_len", default("max_model_len", 4096), kind=int, minimum=16
        ),
        max_num_seqs=r.number("max_num_seqs", default("max_num_seqs", 16), kind=int, minimum=1),
        gpu_memory_fraction=fraction,
        kv_cache_memory=kv_memory,
        engine_args=r.string_list("engine_args"),
        limits=limits,
        timeouts=_read_timeouts(r.section("timeouts"), gateway.timeouts),
        affinity=affinity,
    )
    r.finish()
    return config if name else None


def _read_defaults(r: _Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if r.has("device"):
        out["device"] = r.string("device", "auto", choices=("auto", "cpu", "cuda"))
    if r.has("max_model_len"):
        out["max_model_len"] = r.number("max_model_len", 4096, kind=int, minimum=16)
    if r.has("max_num_seqs"):
        out["max_num_seqs"] = r.number("max_num_seqs", 16, kind=int, minimum=1)
    if r.has("gpu_memory_fraction"):
        out["gpu_memory_fraction"] = r.number(
            "gpu_memory_fraction", None, minimum=0, maximum=1, exclusive_min=True
        )
    if r.has("kv_cache_memory"):
        out["kv_cache_memory"] = r.size("kv_cache_memory")
    r.finish()
    return out


def parse_config(data: Any, file: str = "models.yaml", base_dir: Path | None = None) -> FleetConfig:
    """Validates a parsed YAML document; raises ConfigError listing every problem."""
    problems: list[str] = []
    root = _Reader(data, "", problems, file)
    gateway = _read_gateway(root.section("gateway"))
    defaults = _read_defaults(root.section("defaults"))
    raw_models = root.raw("models")
    models: list[ModelConfig] = []
    if not isinstance(raw_models, list) or not raw_models:
        root.error("models", "must be a non-empty list of models")
        raw_models = []
    served: dict[str, str] = {}
    for i, item in enumerate(raw_models):
        path = f"models[{i}]"
        model = _read_model(
            _Reader(item, path, problems, file), defaults, gateway, base_dir or Path.cwd()
        )
        if model is None:
            continue
        for served_name in (model.name, *model.aliases):
            if served_name in served:
                problems.append(
                    f"{file}: {path}: name or alias {served_name!r} is already used "
                    f"by {served[served_name]}"
                )
            served[served_name] = path
        models.append(model)
    for i, key in enumerate(gateway.auth.keys):
        for allowed in key.models or ():
            if allowed not in served:
                problems.append(f"{file}: gateway.auth.keys[{i}].models: unknown model {allowed!r}")
    local = [m for m in models if m.local]
    if len(local) == 1 and local[0].replicas == 1:  # the only engine (ModelConfig.spin_wait)
        models = [replace(m, spin_wait=True) if m is local[0] else m for m in models]
    gpu_sum = sum(gpu_share(m) * m.replicas for m in models)
    if gpu_sum > MAX_GPU_FRACTION_SUM:
        problems.append(
            f"{file}: models: gpu_memory_fraction x replicas sums to {gpu_sum:.2f} on "
            f"the GPU; it must be <= {MAX_GPU_FRACTION_SUM}"
        )
    root.finish()
    if problems:
        raise ConfigError(problems)
    return FleetConfig(path=file, gateway=gateway, models=tuple(models))


def gpu_share(model: ModelConfig) -> float:
    """The GPU memory fraction one replica of ``model`` takes (0: not on a GPU). Every GPU counts
    as one card, as the sum check does."""
    if not model.local or model.device == "cpu":
        return 0.0
    return model.gpu_memory_fraction or 0.0


def load_config(path: str | os.PathLike[str]) -> FleetConfig:
    """Reads and validates a models.yaml file; raises ConfigError listing every problem."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{file}: {where}invalid YAML: {problem}"]) from exc
    return parse_config(data, file, Path(path).resolve().parent)


def with_listen(config: FleetConfig, host: str | None, port: int | None) -> FleetConfig:
    """Command-line overrides of the listen address."""
    gateway = replace(
        config.gateway,
        host=host or config.gateway.host,
        port=port if port is not None else config.gateway.port,
    )
    if gateway.auth.open_mode and not _is_loopback(gateway.host):
        raise ConfigError(
            [
                f"{config.path}: --host {gateway.host}: open mode (no API keys) only "
                "binds loopback addresses"
            ]
        )
    return replace(config, gateway=gateway)
