"""common/connections.py: caps that make room by closing idle connections, oldest first, and
refuse only when a scope is full of busy ones."""

from __future__ import annotations

import subprocess
import sys

from common.connections import ConnectionTable


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


def test_total_cap_evicts_the_longest_idle_then_refuses_when_all_are_busy():
    table = ConnectionTable(max_connections=3, max_per_address=10)
    a, b, c = Conn("a"), Conn("b"), Conn("c")
    for conn in (a, b, c):
        assert table.open(conn, "10.0.0.1") is None
    table.busy(a)
    d = Conn("d")
    assert table.open(d, "10.0.0.2") is None  # b has been idle longest (a is busy)
    assert b.evicted and not a.evicted and not c.evicted and len(table) == 3
    table.busy(c)
    table.busy(d)
    refusal = table.open(Conn("e"), "10.0.0.3")
    assert refusal is not None and refusal.status == 503
    assert refusal.code == "too_many_connections" and refusal.headers["Retry-After"] == "1"
    assert len(table) == 3 and table.refusals == 1 and table.evictions == 1


def test_idle_again_after_a_response_goes_to_the_back_of_the_line():
    table = ConnectionTable(max_connections=2, max_per_address=10)
    a, b = Conn("a"), Conn("b")
    table.open(a, "x")
    table.open(b, "x")
    table.busy(a)
    table.idle(a)  # a finished a request after b went idle: b is the older idle one
    table.open(Conn("c"), "y")
    assert b.evicted and not a.evicted


def test_address_cap_evicts_only_that_address_and_refuses_with_429():
    table = ConnectionTable(max_connections=100, max_per_address=2)
    mine = [Conn("m1"), Conn("m2")]
    other = Conn("o1")
    table.open(other, "10.0.0.9")
    for conn in mine:
        table.open(conn, "10.0.0.1")
    assert table.open(Conn("m3"), "10.0.0.1") is None
    assert mine[0].evicted and not other.evicted
    table.busy(mine[1])
    for conn in list(table._address):
        table.busy(conn)
    refusal = table.open(Conn("m4"), "10.0.0.1")
    assert refusal is not None and refusal.status == 429
    assert table.open(Conn("o2"), "10.0.0.9") is None  # other addresses are unaffected


def test_close_is_idempotent_and_frees_the_slot():
    table = ConnectionTable(max_connections=1, max_per_address=1)
    a = Conn("a")
    table.open(a, "x")
    table.busy(a)
    table.close(a)
    table.close(a)
    assert len(table) == 0
    assert table.open(Conn("b"), "x") is None


def test_fd_limit_is_raised_and_the_cap_fits_what_is_left(tmp_path):
    # In a child process: the limits changed there stay there.
    script = """
import logging, resource
from aiohttp import web
from common.http_server import ClientLimits, GuardedRunner, raise_fd_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
assert raise_fd_limit(logging.getLogger()) == hard
resource.setrlimit(resource.RLIMIT_NOFILE, (320, 320))  # a hard limit this low cannot be raised
runner = GuardedRunner(web.Application(), error_body=lambda *a: b"", name="t",
    log=logging.getLogger(), limits=ClientLimits(max_connections=8192),
    max_body_bytes=lambda: 1, fds_per_connection=2)
print(runner._connection_cap())
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == (320 - 64) // 2  # two files per connection, a reserve kept
    assert "capping at 128" in result.stderr
