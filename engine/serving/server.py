"""The engine's server process: bind, load the model while /health already answers, serve until
SIGTERM/SIGINT or a dead engine loop, then drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import uvloop
from aiohttp import web

from common.errors import error_body
from common.http_server import GuardedRunner
from engine import startup
from engine.config import EngineConfig
from engine.serving.app import SETTINGS_KEY, ServerSettings, create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.options import ServerOptions

log = logging.getLogger("engine.server")


class EngineRunner(GuardedRunner):
    """``web.AppRunner`` whose refusals before the app (oversized headers, malformed HTTP,
    connection caps and deadlines: common/http_server.py) are OpenAI-shaped JSON too."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        settings = app[SETTINGS_KEY]
        super().__init__(
            app,
            error_body=error_body,
            name="engine",
            log=log,
            limits=settings.client_limits,
            max_body_bytes=lambda: settings.max_body_bytes,
            **kwargs,
        )


def serve(config: EngineConfig, options: ServerOptions) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a graceful shutdown, 1 if loading failed."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return uvloop.run(_serve(config, options))


async def _serve(config: EngineConfig, options: ServerOptions) -> int:
    from engine.core.engine_core import EngineCore  # imports torch: only in the serving process

    engine = AsyncEngine(
        lambda: EngineCore.for_serving(config),
        options.served_model_names[0],
        max_queue=config.max_queue,
    )
    settings = ServerSettings(
        options.served_model_names,
        options.max_body_bytes,
        max_header_bytes=options.max_header_bytes,
        client_limits=options.client_limits,
    )
    app = create_app(engine, settings)
    runner = EngineRunner(
        app,
        handler_cancellation=True,  # a client disconnect cancels its handler, which aborts
        shutdown_timeout=5.0,  # for handlers still writing after engine.drain() ended them
        access_log=logging.getLogger("aiohttp.access") if options.log_level == "debug" else None,
    )
    await runner.setup()
    await web.TCPSite(runner, options.host, options.port).start()
    host, port = runner.addresses[0][:2]
    log.info(
        "listening on http://%s:%d (served names: %s)",
        host,
        port,
        ", ".join(options.served_model_names),
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    startup.record("imports and http server", startup.since_start())
    log.info("loading model %s", config.model)
    started = time.monotonic()
    engine.start()
    loaded = asyncio.ensure_future(engine.wait_loaded())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loaded.done() and loaded.exception() is not None:
        error = loaded.exception()
        log.error("model load failed: %s: %s", type(error).__name__, error)
        stop.set()
        code = 1
    elif loaded.done():
        startup.mark_loaded()
        _log_loaded(engine, time.monotonic() - started)
        log.info(
            "ready %.2f s after the process started: %s", startup.since_start(), startup.summary()
        )
        # A dead step loop cannot recover in this process: exit non-zero so that a supervisor
        # (the gateway's pool, systemd, Kubernetes) starts a fresh one.
        died = asyncio.ensure_future(engine.wait_dead())
        await asyncio.wait([died, stopping], return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            error = died.result()
            log.error("engine loop died (%s: %s): exiting", type(error).__name__, error)
            code = 1
        died.cancel()
    if not stopping.done():
        stop.set()
    await stopping
    loaded.cancel()
    log.info(
        "shutting down: %d requests in flight get up to %.0f s to finish",
        engine.num_in_flight,
        options.shutdown_timeout,
    )
    for site in list(runner.sites):  # stop listening; open connections carry on
        await site.stop()
    await engine.drain(options.shutdown_timeout)
    await runner.cleanup()
    log.info("stopped")
    return code


def _log_loaded(engine: AsyncEngine, seconds: float) -> None:
    stats = engine.core.stats() if engine.core is not None else None
    if stats is None:
        return
    tokens = stats.num_blocks * stats.block_size
    log.info(
        "model loaded in %.1f s: KV cache %d blocks x %d tokens = %d tokens, max concurrency "
        "at max_model_len %d: %.1f",
        seconds,
        stats.num_blocks,
        stats.block_size,
        tokens,
        engine.max_model_len,
        tokens / max(engine.max_model_len, 1),
    )
