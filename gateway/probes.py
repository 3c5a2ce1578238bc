"""What load balancers and Prometheus poll: ``/health`` (the process answers), ``/ready`` (some
model can serve, and the gateway is not draining) and ``/metrics``."""

from __future__ import annotations

from aiohttp import web

from gateway.state import GATEWAY_KEY


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    ok, models = gateway.ready()
    return web.json_response(
        {"ready": ok, "draining": gateway.draining, "models": models}, status=200 if ok else 503
    )


async def metrics(request: web.Request) -> web.Response:
    metrics = request.app[GATEWAY_KEY].metrics
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})
