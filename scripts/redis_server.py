"""A throwaway redis-server (Debian's package; ``make test`` installs it) for tests and benchmarks:
loopback only, on a free port, no persistence, its files in a folder of the caller's. It can be
killed and started again on the same port, as an outage and a recovery look to a gateway."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from pathlib import Path

from common.net import free_port
from scripts.child_server import ChildServer


class RedisServer(ChildServer):
    what = "redis-server"

    def __init__(self, folder: Path, port: int | None = None, password: str | None = None) -> None:
        self.folder = folder
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server missing: `make test` installs Debian's redis-server")
        command = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.folder),
        ]
        command += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.password:
            command += ["--requirepass", self.password]
        with (self.folder / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_answering(self.answers, timeout, 0.02)
        return self

    def answers(self) -> bool:
        """Whether it answers PING (an unauthenticated one gets NOAUTH: it answers all the same)."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock,
        ):
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        return False
