"""Model name or alias → replica set → one backend.

Balancing is least outstanding requests over two random choices. With affinity on, a request's key
(its prompt prefix or `user`) picks a replica by rendezvous hashing, so one prefix keeps landing
where its prefix cache is warm, unless that replica is unavailable or busier than the least loaded
one by more than ``max_extra_load``.

Backends of a model come from a list of URLs: the static ``upstreams`` of external models, or what
the engine pool reports for local ones (``set_backends``). Backend objects survive config reloads
that keep their URL, so their health state and in-flight counts carry over.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable

from gateway.backend import Backend, Condition, StateListener
from gateway.config import FleetConfig, ModelConfig


class ModelRoute:
    """A served model: its config, its backends and its in-flight count."""

    __slots__ = ("backends", "config", "inflight")

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.backends: list[Backend] = []
        self.inflight = 0

    @property
    def name(self) -> str:
        return self.config.name

    def pick(
        self,
        exclude: Iterable[Backend] = (),
        affinity_key: bytes | None = None,
    ) -> Backend | None:
        """A backend for the next attempt, or None when no untried one is available."""
        candidates = [b for b in self.backends if b.available and b not in exclude]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        if affinity_key is not None:
            seed = zlib.crc32(affinity_key)
            warm = max(candidates, key=lambda b: zlib.crc32(b.url_bytes, seed))
            least = min(b.outstanding for b in candidates)
            if warm.outstanding - least <= self.config.affinity.max_extra_load:
                return warm
        if len(candidates) == 2:
            first, second = candidates
        else:
            first, second = random.sample(candidates, 2)
        if first.outstanding == second.outstanding:
            return first if random.random() < 0.5 else second
        return first if first.outstanding < second.outstanding else second


class Router:
    def __init__(self, on_backend_state: StateListener | None = None) -> None:
        self.routes: dict[str, ModelRoute] = {}  # canonical name → route
        self._lookup: dict[str, ModelRoute] = {}  # name or alias → route
        self._listener = on_backend_state  # given to every backend (GatewayMetrics' hook)

    def resolve(self, name: str) -> ModelRoute | None:
        return self._lookup.get(name)

    def apply(self, config: FleetConfig) -> list[Backend]:
        """Installs a (validated) config; returns the backends that left the fleet."""
        removed: list[Backend] = []
        routes: dict[str, ModelRoute] = {}
        for model in config.models:
            route = self.routes.get(model.name) or ModelRoute(model)
            was_local = route.config.local
            route.config = model
            routes[model.name] = route
            if not model.local:
                removed += self._set_urls(route, model.upstreams)
            elif not was_local:  # now spawned locally: the pool will report its URLs
                removed += self._set_urls(route, ())
        for name, route in self.routes.items():
            if name not in routes:
                removed += self._set_urls(route, ())
        self.routes = routes
        self._lookup = {}
        for route in routes.values():
            for served in (route.name, *route.config.aliases):
                self._lookup[served] = route
        return removed

    def set_backends(self, model: str, urls: Iterable[str]) -> tuple[list[Backend], list[Backend]]:
        """For the engine pool: the URLs now serving a local model. Returns (added, removed)."""
        route = self.routes.get(model)
        if route is None:  # the model left the config; its backends left with it
            return [], []
        before = set(route.backends)
        removed = self._set_urls(route, tuple(urls))
        return [b for b in route.backends if b not in before], removed

    def _set_urls(self, route: ModelRoute, urls: tuple[str, ...]) -> list[Backend]:
        current = {b.url: b for b in route.backends}
        route.backends = [
            current.get(url) or Backend(route.name, url, self._listener) for url in urls
        ]
        kept = set(urls)
        removed = [b for url, b in current.items() if url not in kept]
        for backend in removed:
            backend.set_condition(Condition.REMOVED)
        return removed

    def find(self, model: str, url: str) -> Backend | None:
        route = self.routes.get(model)
        return next((b for b in route.backends if b.url == url), None) if route else None

    def backends(self) -> list[Backend]:
        return [b for route in self.routes.values() for b in route.backends]
