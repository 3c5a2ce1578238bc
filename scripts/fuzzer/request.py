"""One fuzz request (``Case``) and the well-formed headers the families start from."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from scripts.fuzzer.bodies import valid_bytes
from scripts.fuzzer.profile import CHAT, COMPLETIONS, Profile


@dataclass(frozen=True)
class Case:
    """One request: ``raw`` bytes when given (sent as they are), else the request built from
    method, path, headers and body (headers complete: nothing is added when sending)."""

    label: str  # what is fuzzed; findings are grouped by it
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    raw: bytes | None = None
    # The request is unfinished on purpose (declared body or head not all sent): the server may
    # wait for the rest, so no answer is right; an answer (408, 400, 413) must still be JSON.
    incomplete: bool = False
    # Not HTTP at all (TLS, HTTP/2 preface, binary noise, HTTP/0.9): closing without an answer
    # is right, as no HTTP/1.x answer can be understood; an answer must still be JSON.
    may_close: bool = False
    # Gateway: routed to the model whose upstream is down, so 502/503/504 are the right answers.
    unavailable_ok: bool = False
    seed: int = 0
    index: int = 0

    def wire(self) -> bytes:
        if self.raw is not None:
            return self.raw
        head = [f"{self.method} {self.path} HTTP/1.1".encode("latin-1")]
        head += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body

    def excerpt(self, limit: int = 240) -> str:
        """The request as a report shows it: bytes escaped, long runs cut."""
        data = self.wire()
        text = repr(data[:limit])
        return text + (f" ...(+{len(data) - limit} bytes)" if len(data) > limit else "")


def auth_headers(p: Profile, path: str) -> list[tuple[bytes, bytes]]:
    key = p.admin_key if path.startswith("/admin") else p.api_key
    return [(b"Authorization", b"Bearer " + key.encode())] if key else []


def request_headers(p: Profile, path: str, body: bytes) -> list[tuple[bytes, bytes]]:
    """A well-formed request's headers, the valid key included; cases then change them."""
    return [
        (b"Host", b"127.0.0.1"),
        (b"Content-Type", b"application/json"),
        *auth_headers(p, path),
        (b"Content-Length", str(len(body)).encode()),
    ]


def post(p: Profile, path: str, body: bytes, label: str, **flags: Any) -> Case:
    return Case(label, "POST", path, tuple(request_headers(p, path, body)), body, **flags)


def replace_header(
    headers: list[tuple[bytes, bytes]], name: bytes, values: list[bytes]
) -> tuple[tuple[bytes, bytes], ...]:
    kept = [(n, v) for n, v in headers if n.lower() != name.lower()]
    return tuple(kept + [(name, v) for v in values])


def completion_request(rng: random.Random, p: Profile) -> tuple[str, bytes]:
    path = rng.choice([CHAT, COMPLETIONS])
    return path, valid_bytes(rng, p, path)
