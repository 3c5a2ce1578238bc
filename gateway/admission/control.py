"""Every model's line, built from the config and kept across reloads (with its counters), and the
tenant each API key is: its name, band, weight and sheddability. In open mode (no keys) every
client is one tenant, ``ANONYMOUS``: loopback clients are one operator's."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from common.errors import RequestRefused
from gateway.admission.line import Explain, ModelLine, Seat, Supply, no_load, nothing_coming
from gateway.admission.scheduler import Tenant
from gateway.backend import Backend, BackendState
from gateway.config import ApiKey, FleetConfig
from gateway.metrics import GatewayMetrics
from gateway.router import ModelRoute

ANONYMOUS = Tenant("_anonymous")


class AdmissionControl:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        # the residency manager's (Gateway wires it): a local model's replicas come on request
        self.supply: Supply = nothing_coming
        self.explain: Explain = no_load  # the residency manager's too: where a load stands
        self.lines: dict[str, ModelLine] = {}
        self._tenants: dict[str, Tenant] = {}

    def configure(self, config: FleetConfig, routes: Mapping[str, ModelRoute]) -> None:
        """Applies a (re)loaded config; ``routes``: the router's, already applied. The requests
        waiting for a model that left the config are refused."""
        self._tenants = {key.name: _tenant(key) for key in config.gateway.auth.keys}
        tenants = list(self._tenants.values()) or [ANONYMOUS]  # open mode: one tenant
        names = {tenant.name for tenant in tenants}
        bands = {tenant.band for tenant in tenants}
        lines: dict[str, ModelLine] = {}
        for name, route in routes.items():
            line = self.lines.get(name) or ModelLine(route, self.metrics, self.supply, self.explain)
            line.supply, line.explain = self.supply, self.explain
            line.configure(route, names)
            self.metrics.declare_admission(name, bands, names)
            lines[name] = line
        for name, line in self.lines.items():
            if name not in lines:
                line.refuse(lambda name=name: _removed(name))
        self.lines = lines

    def seat(self, route: ModelRoute, key: ApiKey | None, prompt_tokens: int) -> Seat:
        """A request's place in its model's line (not taken yet: ``Seat.take``)."""
        line = self.lines.get(route.name)
        if line is None:  # removed by a reload since the request was routed
            raise _removed(route.name)
        # (a key authenticated just before a reload that changed it: as it was then)
        tenant = ANONYMOUS if key is None else self._tenants.get(key.name) or _tenant(key)
        return Seat(line, tenant, prompt_tokens)

    def waiting(self, model: str) -> int:
        line = self.lines.get(model)
        return line.waiting if line else 0

    def refuse(self, model: str, failure: Callable[[], RequestRefused]) -> None:
        """Answers every request waiting in ``model``'s line with a ``failure()`` of its own."""
        line = self.lines.get(model)
        if line is not None:
            line.refuse(failure)

    def pump(self, model: str) -> None:
        """``model``'s backends changed: slots may have come."""
        line = self.lines.get(model)
        if line is not None:
            line.pump()

    def backend_changed(self, backend: Backend, before: BackendState | None) -> None:
        """The router's backend state listener: a backend that became available brings slots
        (a new one is pumped for by whoever adds it, once the router lists it)."""
        if before is not None and backend.available:
            self.pump(backend.model)


def _tenant(key: ApiKey) -> Tenant:
    return Tenant(key.name, key.priority, key.weight, key.sheddable)


def _removed(model: str) -> RequestRefused:
    return RequestRefused(
        404,
        f"The model '{model}' was removed from the configuration.",
        param="model",
        code="model_not_found",
    )
