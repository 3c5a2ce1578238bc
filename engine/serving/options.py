"""What the command line tells the server process beyond EngineConfig: the names it serves the
model under, where to listen, how long to drain, and the HTTP limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.http_server import ClientLimits


@dataclass
class ServerOptions:
    served_model_names: list[str]  # what clients put in "model"; the first names it in metrics
    host: str
    port: int
    max_body_bytes: int
    shutdown_timeout: float
    log_level: str
    max_header_bytes: int = 8190
    client_limits: ClientLimits = field(default_factory=ClientLimits)
