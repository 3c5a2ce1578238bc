"""One entry of the ``models`` list: a local model (``source``, spawned by the engine pool) or an
external one (``upstreams``, routed to), with its limits, affinity, timeouts and admission."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config.admission import read_model_admission, read_queue
from gateway.config.defaults import read_engine_settings
from gateway.config.gateway_settings import read_timeouts
from gateway.config.reader import Reader
from gateway.config.residency import read_residency
from gateway.config.schema import (
    AFFINITY_KINDS,
    Affinity,
    Capabilities,
    GatewaySettings,
    ModelConfig,
    ModelDefaults,
    ModelLimits,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
# Keys that configure engine processes, so only a local model may set them.
_LOCAL_KEYS = (
    "replicas",
    "device",
    "gpu_memory_fraction",
    "kv_cache_memory",
    "engine_args",
    "memory_estimate",
)


def read_model(
    r: Reader, defaults: ModelDefaults, gateway: GatewaySettings, base_dir: Path
) -> ModelConfig | None:
    """The model, or None when it has no usable name (the problem is reported)."""
    d = ModelConfig(name="")
    name = r.string("name")
    if name is None:
        r.error("name", "is required")
    elif not _NAME_RE.match(name):
        r.error("name", f"{name!r} may only contain letters, digits and ._:/@+- (max 128)")
    aliases = r.string_list("aliases")
    for alias in aliases:
        if not _NAME_RE.match(alias):
            r.error("aliases", f"{alias!r} may only contain letters, digits and ._:/@+-")
    upstreams = _read_upstreams(r)
    source = _read_source(r, upstreams, base_dir)
    replicas = r.integer("replicas", d.replicas, maximum=64)
    engine = read_engine_settings(r, defaults)
    if source is None:
        for key in _LOCAL_KEYS:
            if r.has(key):
                r.error(key, "only applies to local models (with `source`)")
    health_path = r.string("health_path", d.health_path)
    if health_path and not health_path.startswith("/"):
        r.error("health_path", f"must start with '/', got {health_path!r}")
    api_key_env, api_key = (None, None)
    if r.has("api_key_env"):
        api_key_env, api_key = r.env_secret("api_key_env", required=False)
    config = ModelConfig(
        name=name or "",
        aliases=aliases,
        upstreams=upstreams,
        source=source,
        api_key_env=api_key_env,
        api_key=api_key,
        health_path=health_path or d.health_path,
        replicas=replicas if source else len(upstreams),
        device=engine.device,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        gpu_memory_fraction=engine.gpu_memory_fraction,
        kv_cache_memory=engine.kv_cache_memory,
        limits=_read_limits(r.section("limits")),
        affinity=_read_affinity(r.section("affinity")),
        capabilities=_read_capabilities(r, local=source is not None),
        upstream_model=r.string("upstream_model"),
        engine_args=r.string_list("engine_args"),
        timeouts=read_timeouts(r.section("timeouts"), gateway.timeouts),
        queue=read_queue(r.section("queue")),
        admission=read_model_admission(r.section("admission"), gateway.admission),
        **read_residency(r, local=source is not None),
    )
    r.finish()
    return config if name else None


def _read_upstreams(r: Reader) -> tuple[str, ...]:
    upstreams: list[str] = []
    for i, url in enumerate(r.string_list("upstreams")):
        normalised = _normalise_upstream(url, r, f"upstreams[{i}]")
        if normalised:
            upstreams.append(normalised)
    if len(set(upstreams)) != len(upstreams):
        r.error("upstreams", "lists the same URL twice")
    return tuple(upstreams)


def _normalise_upstream(url: str, r: Reader, key: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        r.error(key, f"{url!r} is not an http(s) URL")
        return None
    if parts.query or parts.fragment:
        r.error(key, f"{url!r} must not have a query or fragment")
        return None
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url  # the gateway appends /v1/...


def _read_source(r: Reader, upstreams: tuple[str, ...], base_dir: Path) -> str | None:
    """The local model's path, resolved against the file's folder; exactly one of ``source``
    and ``upstreams`` must be there."""
    source = r.string("source")
    if source is not None and r.has("upstreams"):
        r.error("source", "a model has either `source` (spawned locally) or `upstreams`, not both")
    elif source is None and not upstreams and not r.has("upstreams"):
        r.error(None, "needs `source` (a local model to spawn) or `upstreams` (URLs to route to)")
    elif r.has("upstreams") and not upstreams and source is None:
        r.error("upstreams", "must list at least one URL")
    if source is None:
        return None
    resolved = Path(source) if Path(source).is_absolute() else base_dir / source
    if not resolved.exists():
        r.error("source", f"{resolved} does not exist")
    return str(resolved)


def _read_limits(r: Reader) -> ModelLimits:
    d = ModelLimits()
    limits = ModelLimits(
        rpm=r.integer("rpm", d.rpm),
        tpm=r.integer("tpm", d.tpm),
        max_concurrency=r.integer("max_concurrency", d.max_concurrency),
    )
    r.finish()
    return limits


def _read_capabilities(r: Reader, local: bool) -> Capabilities:
    """``capabilities: {tools: false, ...}``: only an external model may lack a feature."""
    if local and r.has("capabilities"):
        r.error(
            "capabilities",
            "only applies to external models (with `upstreams`): local "
            "engines support every feature",
        )
    section = r.section("capabilities")
    d = Capabilities()
    capabilities = Capabilities(
        tools=section.boolean("tools", d.tools),
        structured_outputs=section.boolean("structured_outputs", d.structured_outputs),
    )
    section.finish()
    return capabilities


def _read_affinity(r: Reader) -> Affinity:
    d = Affinity()
    affinity = Affinity(
        by=r.string("by", d.by, choices=AFFINITY_KINDS) or d.by,
        prefix_chars=r.integer("prefix_chars", d.prefix_chars),
        max_extra_load=r.integer("max_extra_load", d.max_extra_load, minimum=0),
    )
    r.finish()
    return affinity
