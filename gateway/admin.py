"""Admin endpoints (admin key required): backend states, config reload, drain, and the scrape
targets for Prometheus' HTTP service discovery."""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from common.errors import RequestRefused
from common.json_body import parse_json
from common.request_body import read_body
from gateway.backend import Condition
from gateway.config import ConfigError
from gateway.state import GATEWAY_KEY

ADMIN_MAX_BODY = 64 * 1024


async def backends(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    models = []
    for route in gw.router.routes.values():
        config = route.config
        entry = {
            "name": config.name,
            "aliases": list(config.aliases),
            "local": config.local,
            "in_flight": route.inflight,
            "backends": [b.describe() for b in route.backends],
        }
        if config.local:
            entry["replicas"] = [r.describe() for r in gw.pool.replicas.get(config.name, [])]
        models.append(entry)
    return web.json_response({"draining": gw.draining, "models": models})


async def reload(request: web.Request) -> web.Response:
    try:
        config = await request.app[GATEWAY_KEY].reload()
    except ConfigError as exc:
        raise RequestRefused(
            400, "Config rejected, fleet unchanged:\n" + str(exc), code="invalid_config"
        ) from exc
    return web.json_response({"status": "reloaded", "models": [m.name for m in config.models]})


async def drain(request: web.Request) -> web.Response:
    """``{"backend": "host:port" | URL, "model": optional, "drain": true|false}`` takes a
    backend out of (or back into) rotation; without ``backend`` it drains the whole gateway:
    /ready answers 503 so a load balancer moves traffic away, while requests still work."""
    gw = request.app[GATEWAY_KEY]
    timeout_s = gw.config.gateway.clients.body_timeout_s
    body = parse_json(await read_body(request, ADMIN_MAX_BODY, timeout_s) or b"{}")
    if not isinstance(body, dict):
        raise RequestRefused(400, "Request body must be a JSON object.", code="invalid_json")
    drain = body.get("drain", True)
    if not isinstance(drain, bool):
        raise RequestRefused(400, "'drain' must be a boolean.", param="drain")
    target = body.get("backend")
    if target is None:
        gw.draining = drain
        return web.json_response({"draining": drain})
    model = body.get("model")
    matched = [
        b
        for b in gw.router.backends()
        if target in (b.url, b.label) and (model is None or b.model == model)
    ]
    if not matched:
        raise RequestRefused(
            404, f"No backend {target!r}.", param="backend", code="backend_not_found"
        )
    for backend in matched:
        backend.set_condition(Condition.DRAINING, drain)
    return web.json_response({"backends": [b.describe() for b in matched]})


async def prometheus_targets(request: web.Request) -> web.Response:
    """Prometheus ``http_sd_configs``: one target group per running local engine, labelled
    ``model`` and ``replica``; with ``?external=true`` also every external upstream (label
    ``replica`` = its host:port), which Prometheus then scrapes at ``<its URL>/metrics``.
    Engines listen on ports chosen at spawn time and change on restart, so a static list
    goes stale; Prometheus polls this instead (``refresh_interval``)."""
    gw = request.app[GATEWAY_KEY]
    groups: list[dict] = []
    for model, replicas in gw.pool.replicas.items():
        for index, replica in enumerate(replicas):
            if replica.proc is None or replica.proc.returncode is not None:
                continue  # not running: between restarts, or stopped
            groups.append(
                {
                    "targets": [f"127.0.0.1:{replica.port}"],
                    "labels": {"model": model, "replica": str(index), "kind": "local"},
                }
            )
    if request.query.get("external", "").lower() in ("1", "true", "yes"):
        for route in gw.router.routes.values():
            for upstream in route.config.upstreams:
                groups.append(_external_target(route.config.name, upstream))
    return web.json_response(groups)


def _external_target(model: str, url: str) -> dict:
    """host:port only: never the user:password@ an upstream URL may carry."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # IPv6
    address = f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    return {
        "targets": [address],
        "labels": {
            "model": model,
            "replica": address,
            "kind": "external",
            "__scheme__": parts.scheme,
            "__metrics_path__": parts.path.rstrip("/") + "/metrics",
        },
    }
