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
from urllib.parse import urlsplit

from gateway.config import FleetConfig, ModelConfig


class Backend:
    """One upstream server of one model, with the state that routing and health checks share."""

    __slots__ = (
        "available",
        "check_fail_streak",
        "check_ok_streak",
        "consecutive_failures",
        "draining",
        "ejected",
        "ejected_until",
        "ejection_count",
        "failure_signatures",
        "healthy",
        "label",
        "last_readmit",
        "model",
        "outstanding",
        "removed",
        "repeated_failures",
        "url",
        "url_bytes",
        "waiting",
    )

    def __init__(self, model: str, url: str) -> None:
        self.model = model
        self.url = url
        self.url_bytes = url.encode()
        # Bounded (one per configured backend) and without any user:password@ of the URL.
        parts = urlsplit(url)
        self.label = parts.netloc.rpartition("@")[2] + parts.path
        self.outstanding = 0
        self.healthy = True  # optimistic until the first check, which runs at once
        self.ejected = False
        self.ejected_until = 0.0
        self.ejection_count = 0
        # The passive failure streak (see HealthMonitor.record_failure): failures that count toward
        # ejection, the signatures of the upstream's own error answers among them, and answers
        # that repeated one of those signatures (counted only toward an active check).
        self.consecutive_failures = 0
        self.failure_signatures: set[int] = set()
        self.repeated_failures = 0
        self.check_ok_streak = 0
        self.check_fail_streak = 0
        self.last_readmit = 0.0
        self.draining = False
        self.removed = False
        self.available = True
        self.waiting: set = set()  # exchanges whose attempt here has sent nothing to the client

    def refresh(self) -> None:
        self.available = (
            self.healthy and not self.ejected and not self.draining and not self.removed
        )

    def clear_failures(self) -> None:
        """Ends the passive failure streak."""
        self.consecutive_failures = 0
        self.repeated_failures = 0
        self.failure_signatures.clear()

    def state(self) -> dict:
        return {
            "url": self.url,
            "available": self.available,
            "healthy": self.healthy,
            "ejected": self.ejected,
            "ejection_count": self.ejection_count,
            "draining": self.draining,
            "outstanding": self.outstanding,
            "consecutive_failures": self.consecutive_failures,
        }


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
    def __init__(self) -> None:
        self.routes: dict[str, ModelRoute] = {}  # canonical name → route
        self._lookup: dict[str, ModelRoute] = {}  # name or alias → route

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

    @staticmethod
    def _set_urls(route: ModelRoute, urls: tuple[str, ...]) -> list[Backend]:
        current = {b.url: b for b in route.backends}
        route.backends = [current.get(url) or Backend(route.name, url) for url in urls]
        kept = set(urls)
        removed = [b for url, b in current.items() if url not in kept]
        for backend in removed:
            backend.removed = True
            backend.refresh()
        return removed

    def find(self, model: str, url: str) -> Backend | None:
        route = self.routes.get(model)
        return next((b for b in route.backends if b.url == url), None) if route else None

    def backends(self) -> list[Backend]:
        return [b for route in self.routes.values() for b in route.backends]
