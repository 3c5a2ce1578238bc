"""Admin endpoints for residency (admin key required): ``GET /admin/models`` shows each model's
state, footprint and what it holds now, requests in flight and queued in its line
(gateway/admission), completion tokens per second over the last minute, its idle time and what is
left of its idle TTL, and its replicas (uptime, restarts, measured memory, load progress, log
files), the memory budget (``modelyard ps`` shows it) and the latest replica failures; ``POST
/admin/models/{name}/load``, ``/park`` and ``/unload`` act on one local model and answer when
done."""

from __future__ import annotations

from aiohttp import web

from common.errors import RequestRefused, excerpt
from gateway.residency import ResidencyManager
from gateway.residency.plan import Eviction
from gateway.state import GATEWAY_KEY, Gateway


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    residency = gw.residency
    listed = []
    for route in gw.router.routes.values():
        entry: dict[str, object] = {
            "name": route.name,
            "aliases": list(route.config.aliases),
            "local": route.config.local,
            "in_flight": route.inflight,
            "completion_tokens_per_s": round(gw.token_rates.per_second(route.name), 3),
            "queued_requests": gw.admission.waiting(route.name),
        }
        if route.name in residency.models:
            entry.update(residency.describe(route.name))
        else:
            entry["state"] = "ready" if any(b.available for b in route.backends) else "unavailable"
        listed.append(entry)
    return web.json_response(
        {
            "memory": residency.budget(),
            "models": listed,
            "recent_errors": list(gw.pool.recent_errors),
        }
    )


def local_model(gw: Gateway, name: str, param: str) -> str:
    """The canonical name of the local model called ``name`` (or an alias); 404 otherwise."""
    route = gw.router.resolve(name)
    if route is None or route.name not in gw.residency.models:
        raise RequestRefused(
            404, f"No local model '{excerpt(name)}'.", param=param, code="model_not_found"
        )
    return route.name


def _local_model(request: web.Request) -> tuple[ResidencyManager, str]:
    gw = request.app[GATEWAY_KEY]
    return gw.residency, local_model(gw, request.match_info["name"], "name")


async def load(request: web.Request) -> web.Response:
    residency, name = _local_model(request)
    await residency.load(name)  # refused: model_failed, or model_unloaded by an unload meanwhile
    return web.json_response({"model": name, **residency.describe(name)})


async def park(request: web.Request) -> web.Response:
    residency, name = _local_model(request)
    await residency.evict(Eviction(name, "park"), "operator")
    return web.json_response({"model": name, **residency.describe(name)})


async def unload(request: web.Request) -> web.Response:
    residency, name = _local_model(request)
    await residency.unload(name)
    return web.json_response({"model": name, **residency.describe(name)})
