"""A free loopback port: for the engine pool's engines, and for the tests and scripts that start
servers. Another process may take it before it is bound; callers that cannot retry bind port 0."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
