"""Which client connections are open, per address, and which of them are idle, so that a cap on
open connections refuses as little as possible.

At a cap (the server's, or one client address's) the longest-idle connection in that scope is
closed to make room: an idle keep-alive connection holds no request, and HTTP clients open a new
one when theirs is closed. Only when every connection in the scope is busy (a request in
progress, or a request head arriving under its deadline) is the newcomer refused: 503 for the
server's cap, 429 for its own address's. So idle or silent connections, however many, never keep
a valid request out, and a slow one holds its slot only until its deadline.
"""

from __future__ import annotations

from typing import Protocol

from common.errors import RequestRefused


class Evictable(Protocol):
    def evict(self) -> None:
        """Close the connection now (it is idle: nothing is lost)."""


class ConnectionTable:
    def __init__(self, max_connections: int, max_per_address: int) -> None:
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self._address: dict[Evictable, str] = {}
        self._per_address: dict[str, int] = {}
        # Insertion-ordered: the first entry has been idle longest.
        self._idle: dict[Evictable, None] = {}
        self._idle_by_address: dict[str, dict[Evictable, None]] = {}
        self.evictions = 0
        self.refusals = 0

    def __len__(self) -> int:
        return len(self._address)

    def open(self, conn: Evictable, address: str) -> RequestRefused | None:
        """Registers a new connection (idle until its first byte); the refusal to send it
        instead when its scope is full of busy connections."""
        address_full = self._per_address.get(address, 0) >= self.max_per_address
        if address_full and not self._evict_oldest(self._idle_by_address.get(address, {})):
            self.refusals += 1
            return RequestRefused(
                429,
                f"Too many open connections from your address (limit "
                f"{self.max_per_address}); reuse a keep-alive connection or retry later.",
                "too_many_connections",
                headers={"Retry-After": "1"},
                close=True,
            )
        if len(self._address) >= self.max_connections and not self._evict_oldest(self._idle):
            self.refusals += 1
            return RequestRefused(
                503,
                "The server has too many open connections; retry later.",
                "too_many_connections",
                headers={"Retry-After": "1"},
                close=True,
            )
        self._address[conn] = address
        self._per_address[address] = self._per_address.get(address, 0) + 1
        self.idle(conn)
        return None

    def idle(self, conn: Evictable) -> None:
        address = self._address.get(conn)
        if address is None:
            return
        self._idle[conn] = None
        self._idle_by_address.setdefault(address, {})[conn] = None

    def busy(self, conn: Evictable) -> None:
        address = self._address.get(conn)
        if address is None:
            return
        self._idle.pop(conn, None)
        by_address = self._idle_by_address.get(address)
        if by_address is not None:
            by_address.pop(conn, None)
            if not by_address:
                del self._idle_by_address[address]

    def close(self, conn: Evictable) -> None:
        """Forgets a connection; idempotent (eviction and connection loss both call it)."""
        self.busy(conn)
        address = self._address.pop(conn, None)
        if address is None:
            return
        left = self._per_address[address] - 1
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]

    def _evict_oldest(self, idle: dict[Evictable, None]) -> bool:
        victim = next(iter(idle), None)
        if victim is None:
            return False
        self.close(victim)
        self.evictions += 1
        victim.evict()
        return True
