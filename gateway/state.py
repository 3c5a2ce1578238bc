"""The gateway's state: everything one gateway process knows and runs (router, health checks,
proxy, limits, admission, engine pool and residency), built from a validated config and swapped to
a new one on reload. Handlers reach it through ``request.app[GATEWAY_KEY]``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from gateway.access_log import AccessLog
from gateway.admission import AdmissionControl
from gateway.auth import Authenticator
from gateway.backend import Backend, BackendState
from gateway.config import ConfigError, FleetConfig, load_config
from gateway.config_watch import ConfigWatcher
from gateway.engines.logs import EngineLogs, log_folder
from gateway.engines.pool import EnginePool
from gateway.engines.process import ENGINE_LAUNCHER
from gateway.health import HealthMonitor
from gateway.limits import RateLimiter, SharedLimits
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.residency import ResidencyManager
from gateway.router import Router
from gateway.token_rates import TokenRates

log = logging.getLogger("modelyard.gateway")


class Gateway:
    """Everything one gateway process knows. Built from a validated config; ``reload`` swaps in a
    new one only if it validates, so a bad edit leaves the running fleet as it was."""

    def __init__(
        self,
        config: FleetConfig,
        config_path: str | None = None,
        *,
        engine_cwd: str | None = None,
        engine_launcher: tuple[str, ...] = ENGINE_LAUNCHER,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.started_at = int(time.time())
        self.metrics = GatewayMetrics()
        self.admission = AdmissionControl(self.metrics)
        self.router = Router(on_backend_state=self._backend_changed)
        state = config.gateway.state
        self.limiter = RateLimiter(SharedLimits(state, self.metrics) if state else None)
        self.token_rates = TokenRates()  # completion tokens per model, last minute (admin API)
        self.auth = Authenticator(config.gateway.auth)
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        gw = config.gateway
        logs = EngineLogs(gw.engine_logs, log_folder(gw.engine_logs, gw.host, gw.port))
        # Built with every fleet, one without local models too (managing none then): a reload
        # may add some. Their engines start with start().
        self.pool = EnginePool(
            self.set_backends, self.router.find, logs, cwd=engine_cwd, launcher=engine_launcher
        )
        self.residency = ResidencyManager(
            self.pool, self.router, self.metrics, config, self.admission
        )
        self.pool.on_transition = self.residency.on_transition
        self.admission.supply = self.residency.supply
        self.admission.explain = self.residency.load_state
        self.access_log = AccessLog()  # stdout
        self.health: HealthMonitor
        self.proxy: Proxy
        self._reload_lock = asyncio.Lock()
        self._watcher = ConfigWatcher(config_path)
        self._watch_task: asyncio.Task[None] | None = None
        self.router.apply(config)
        self.limiter.configure(config)
        self.admission.configure(config, self.router.routes)
        for model in config.models:
            self.metrics.declare_model(model.name)

    async def start(self) -> None:
        # Idle upstream connections close after 4 s, before common servers' own 5 s keep-alive
        # limit (uvicorn), so the gateway never reuses a connection the upstream is closing.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
        # No Accept-Encoding: upstreams answer uncompressed, so bytes pass through unchanged.
        self.session = aiohttp.ClientSession(
            connector=connector,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        gw = self.config.gateway
        self.health = HealthMonitor(self.router, self.session, gw.health, gw.ejection)
        self.proxy = Proxy(
            self.session,
            self.health,
            self.metrics,
            gw.retries,
            self.residency.engine_crashed,
        )
        self.health.sync()
        await self.limiter.start()
        self.residency.start()
        # In the background: requests for models still loading wait in their hold lines.
        self.pool.apply_soon(self.config)
        if self.config_path and gw.watch_config:
            self._watch_task = asyncio.create_task(
                self._watcher.run(lambda: self.reload_logged("file changed"))
            )
        if self.auth.open_mode:
            log.warning(
                "no API keys configured: open mode, serving loopback clients without authentication"
            )

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        self.access_log.flush()
        await self.residency.stop()
        await self.pool.stop()
        await self.health.close()
        await self.limiter.close()
        if self.session:
            await self.session.close()

    def set_backends(self, model: str, urls: list[str]) -> None:
        """For the engine pool: the URLs now serving a local model (their slots open its line)."""
        _, removed = self.router.set_backends(model, urls)
        self.health.sync(removed)
        self.admission.pump(model)

    def _backend_changed(self, backend: Backend, before: BackendState | None) -> None:
        self.metrics.backend_changed(backend, before)
        self.admission.backend_changed(backend, before)

    async def reload(self) -> FleetConfig:
        """Reloads models.yaml; raises ConfigError (and changes nothing) if it is invalid."""
        if not self.config_path:
            raise ConfigError(["no config file to reload (the models came from the command line)"])
        async with self._reload_lock:
            self._watcher.mark_read()
            try:
                config = await asyncio.to_thread(load_config, self.config_path)
            except ConfigError:
                self.metrics.config_reloads.labels("rejected").inc()
                raise
            self.apply(config)
            self.metrics.config_reloads.labels("applied").inc()
            return config

    async def reload_logged(self, why: str) -> None:
        try:
            config = await self.reload()
        except ConfigError as exc:
            log.error("config reload (%s) rejected, fleet unchanged:\n%s", why, exc)
            return
        log.info("config reloaded (%s): %d models", why, len(config.models))

    def apply(self, config: FleetConfig) -> None:
        old = self.config.gateway
        new = config.gateway
        if (old.host, old.port) != (new.host, new.port):
            log.warning("listen address changes take effect after a restart")
        if (old.max_header_bytes, old.clients) != (new.max_header_bytes, new.clients):
            log.warning(
                "header size limits and client connection limits change after a restart; the "
                "body limit and body_timeout_s apply now"
            )
        if old.state != new.state:
            log.warning("gateway.state changes take effect after a restart")
        if old.engine_logs != new.engine_logs:
            log.warning("gateway.engine_logs changes take effect after a restart")
        removed = self.router.apply(config)
        for model in config.models:
            self.metrics.declare_model(model.name)
        self.health.configure(new.health, new.ejection)
        self.health.sync(removed)
        self.limiter.configure(config)
        self.admission.configure(config, self.router.routes)
        self.auth = Authenticator(new.auth)
        if new.retries != old.retries:
            self.proxy.configure(new.retries)
        self.config = config
        self.residency.configure(config)
        self.pool.apply_soon(config)

    def ready(self) -> tuple[bool, dict[str, bool]]:
        models = {
            name: any(b.available for b in route.backends)
            for name, route in self.router.routes.items()
        }
        return (not self.draining and any(models.values())), models


GATEWAY_KEY = web.AppKey("gateway", Gateway)
