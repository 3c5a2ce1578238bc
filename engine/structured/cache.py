"""The compiled-grammar cache: one entry per constraint, bounded in bytes and in entries.

An entry is charged the bytes its grammar took in the compile worker (measured there; the engine
builds the same grammar). Entries held by someone (a request awaiting its compile, a request
generating with it) are pinned; the budget counts them too, so that the cache and the running
requests together never hold more grammar memory than ``--structured-cache-memory``. Failures are
cached as well (a bad constraint sent again is refused without a compile), at a small fixed
charge. An entry nobody holds any more whose compile has not finished is cancelled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

FAILURE_BYTES = 1024  # what a cached refusal is charged: its message and the entry


@dataclass(eq=False)
class CacheEntry:
    key: Any  # the constraint
    future: Future = field(default_factory=Future)
    holders: int = 0
    charged: int = 0  # bytes counted against the budget
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.future.done()


class GrammarCache:
    """Thread-safe: the event loop, the engine thread and the compile threads all use it."""

    def __init__(self, budget_bytes: int, max_entries: int) -> None:
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.charged_bytes = 0
        self._entries: OrderedDict[Any, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, key: Any) -> tuple[CacheEntry, bool]:
        """The entry for `key` with one more holder, and whether it was made now (the caller then
        starts its compile)."""
        with self._lock:
            entry = self._entries.get(key)
            made = entry is None
            if entry is None:
                entry = self._entries[key] = CacheEntry(key)
                self._trim()
            self._entries.move_to_end(key)
            entry.holders += 1
            return entry, made

    def release(self, entry: CacheEntry) -> None:
        """One holder fewer; a compile nobody waits for any more is cancelled and forgotten."""
        with self._lock:
            entry.holders -= 1
            if entry.holders == 0 and not entry.done:
                entry.cancelled.set()
                entry.future.cancel()
                self._forget(entry)

    def charge(self, entry: CacheEntry, size: int) -> bool:
        """Counts `size` bytes for `entry`, making room by evicting the least recently used
        entries nobody holds; False (nothing charged) when even that leaves too little room."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return False  # cancelled meanwhile
            free = self.budget_bytes - self.charged_bytes + entry.charged  # a re-charge
            for other in list(self._entries.values()):
                if free >= size:
                    break
                if other is not entry and other.holders == 0 and other.done:
                    free += other.charged
                    self._forget(other)
            if free < size:
                return False
            self.charged_bytes += size - entry.charged
            entry.charged = size
            return True

    def forget(self, entry: CacheEntry) -> None:
        """Drops `entry` (a transient failure must not be remembered)."""
        with self._lock:
            self._forget(entry)

    def clear(self) -> None:
        """Drops every entry nobody holds."""
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.holders == 0:
                    self._forget(entry)

    def _forget(self, entry: CacheEntry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self.charged_bytes -= entry.charged
            entry.charged = 0

    def _trim(self) -> None:
        """Over max_entries: the least recently used finished entries nobody holds go."""
        for other in list(self._entries.values()):
            if len(self._entries) <= self.max_entries:
                return
            if other.holders == 0 and other.done:
                self._forget(other)
