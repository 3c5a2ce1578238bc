"""One client request on its way through the proxy, and what the access log reports of it."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.admission import Seat
from gateway.backend import Backend
from gateway.limits import LimitGrant
from gateway.proxy.failures import UpstreamFailure
from gateway.router import ModelRoute


@dataclass(slots=True, eq=False)
class Exchange:
    request_id: str
    path: str
    body: bytes
    stream: bool
    strip_usage: bool
    route: ModelRoute
    grant: LimitGrant
    seat: Seat  # its place in its model's line (gateway/admission)
    affinity_key: bytes | None = None
    client: str = ""  # who asked (API key name, else remote address): part of failure signatures
    started: float = field(default_factory=time.monotonic)
    backend: str = "-"
    status: int = 0
    retries: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    last_failure: UpstreamFailure | None = None
    task: asyncio.Task | None = None  # the handler's task, cancelled if its backend is ejected
    evicted_from: Backend | None = None
    probation: asyncio.Lock | None = None  # held while it runs as a crash suspect (quarantine.py)
    _digest: bytes | None = None

    def digest(self) -> bytes:
        """What identifies the request whoever sends it: its model, path and body (computed on
        first use, which only failures and crashes need)."""
        if self._digest is None:
            key = hashlib.blake2b(digest_size=16)
            for part in (self.route.name.encode(), self.path.encode(), self.body):
                key.update(len(part).to_bytes(8, "little"))
                key.update(part)
            self._digest = key.digest()
        return self._digest

    def usage(self, usage: object) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.prompt_tokens, self.completion_tokens = prompt, completion

    def deadline(self, loop_now: float) -> float:
        """When ``total_s`` runs out, on the event loop's clock (which reads ``loop_now``)."""
        return loop_now + self.route.config.timeouts.total_s - (time.monotonic() - self.started)

    def response_headers(self, hints: Mapping[str, str] | None = None) -> Mapping[str, str]:
        """The request id and the gateway's rate-limit headers. The upstream's back-off hints
        replace the gateway's own headers of the same name, whatever their case: the upstream's
        limit is the one that refused."""
        headers = {"x-request-id": self.request_id, **self.grant.headers}
        if not hints:
            return headers
        replaced = {name.lower() for name in hints}
        return {
            **{name: value for name, value in headers.items() if name.lower() not in replaced},
            **hints,
        }
