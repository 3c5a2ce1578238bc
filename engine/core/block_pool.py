"""The KV cache's blocks, each in exactly one state, and the map of cached prefixes to blocks.

- free: ref count 0, no hash, in ``_free``;
- cached: ref count 0 but holding a full block's hash, in ``_lru`` (reusable on a prefix hit,
  evicted least recently used first when a new block is needed);
- referenced: ref count == number of occurrences in live sequences' block tables.

The pool knows blocks, not sequences: which block a sequence holds, what its blocks' hashes are and
which copies are pending is the block manager's (engine/core/blocks.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    """Ref counts, the free list, the LRU of cached blocks and hash -> block; O(1) per call."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block holding it

    @property
    def num_free(self) -> int:
        """Blocks that can be taken now: truly free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still holding a reusable prefix."""
        return len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def take(self) -> int:
        """A block with one reference: a free one, else the least recently used cached one
        (its prefix forgotten). The caller checks `num_free` first."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)
            del self._cached[self._block_hash[block]]  # type: ignore[index]
            self._block_hash[block] = None
        self._ref[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """One more reference to a held block, or to a cached one (a prefix hit)."""
        if self._ref[block] == 0:
            del self._lru[block]
        self._ref[block] += 1

    def release(self, block: int) -> bool:
        """Drop one reference; True when that was the last (the block is free or cached now)."""
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        if self._block_hash[block] is None:
            self._free.append(block)
        else:
            self._lru[block] = None
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this full block's contents, if one is cached or held."""
        return self._cached.get(block_hash)

    def offer(self, block: int, block_hash: bytes) -> None:
        """Let a just-filled block serve prefix hits for `block_hash`. An identical block may be
        cached already (the same prefix computed twice at once): the first one is kept, and this
        one becomes plain free when released."""
        if self._block_hash[block] is None and block_hash not in self._cached:
            self._block_hash[block] = block_hash
            self._cached[block_hash] = block

    def reset(self) -> None:
        """Every block free and no prefix cached; only while no block is referenced."""
        if any(self._ref):
            raise RuntimeError("blocks are still in use")
        self._block_hash = [None] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._lru.clear()
        self._cached.clear()
