"""The aiohttp application: the composition root that puts the gateway's state, its middlewares
and its handlers together. Every endpoint the gateway serves is listed here."""

from __future__ import annotations

from aiohttp import web

from gateway import admin, admin_logs, admin_models, openai_api, probes, response_headers
from gateway.middlewares import auth, context
from gateway.state import GATEWAY_KEY, Gateway
from gateway.ui import page

__all__ = ["GATEWAY_KEY", "Gateway", "create_app"]


def create_app(gateway: Gateway) -> web.Application:
    gw = gateway.config.gateway
    app = web.Application(
        middlewares=[context, auth],
        # The configured limit is enforced by read_body (and follows reloads); this one only
        # stops aiohttp from refusing first with its own plain-text answer.
        client_max_size=1 << 40,
        handler_args={"max_field_size": gw.max_header_bytes, "max_line_size": gw.max_header_bytes},
    )
    app[GATEWAY_KEY] = gateway
    app.router.add_post(openai_api.CHAT_PATH, openai_api.chat_completions)
    app.router.add_post(openai_api.COMPLETIONS_PATH, openai_api.completions)
    app.router.add_get("/v1/models", openai_api.list_models)
    app.router.add_get("/health", probes.health)
    app.router.add_get("/ready", probes.ready)
    app.router.add_get("/metrics", probes.metrics)
    app.router.add_get("/admin/backends", admin.backends)
    app.router.add_post("/admin/reload", admin.reload)
    app.router.add_post("/admin/drain", admin.drain)
    app.router.add_get("/admin/prometheus/targets", admin.prometheus_targets)
    app.router.add_get("/admin/models", admin_models.models)
    app.router.add_post("/admin/models/{name}/load", admin_models.load)
    app.router.add_post("/admin/models/{name}/park", admin_models.park)
    app.router.add_post("/admin/models/{name}/unload", admin_models.unload)
    app.router.add_get("/admin/logs", admin_logs.logs)
    page.add_routes(app)
    app.on_response_prepare.append(response_headers.add_headers)

    async def end_log_streams(_: web.Application) -> None:
        # before the shutdown waits for handlers: a followed log would hold it for its timeout
        gateway.pool.logs.end_following()

    app.on_shutdown.append(end_log_streams)

    async def lifecycle(app: web.Application):
        await gateway.start()
        yield
        await gateway.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
