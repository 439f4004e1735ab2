"""Reference-counted block allocator shared by the host pool and the GPU block pool.

Block id 0 is the null block in both id spaces: a block table entry of 0 means "no page", so
it is never handed out. The free list is a stack: the most recently freed blocks are handed out
first (in the order they were freed), so repeated requests keep reusing the same memory. The
host pool is allocated lazily by the OS: reusing freed blocks last walked a large pool's
untouched pages one call after another (resident memory grew with every `generate`).
A fresh pool hands out blocks in ascending order.

Prefix caching (`hisparse.engine.prefix_cache`) marks blocks whose content is reusable
(`mark_cached`): such a block, once no request holds it, is not free but *evictable*. It waits
in an LRU list of its own (least recently released first) and counts as free: `allocate` takes
truly free blocks first and evicts the least recently used cached blocks only when those run
out, telling the cache through ``on_evict``. A cache hit takes an evictable block back
(`incref`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK = 0


class BlockPoolExhausted(RuntimeError):
    """Not enough free blocks; nothing was allocated."""


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "block pool") -> None:
        if num_blocks < 2:
            raise ValueError(f"{name} needs at least 2 blocks (the null block and one more).")
        self.name = name
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        #: free blocks, the next one to hand out last
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        #: blocks holding cached content (`mark_cached`), held or not
        self._cached: set[int] = set()
        #: cached blocks no one holds, least recently released first (evicted in that order)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: called with the blocks `allocate` evicts, before it hands them out
        self.on_evict: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no one holds (part of `num_free`)."""
        return len(self._evictable)

    def mark_cached(self, block: int) -> None:
        """``block`` (held) holds reusable content: when its last holder frees it, it waits
        in the LRU list instead of the free list."""
        self._check(block)
        if self._ref[block] == 0:
            raise ValueError(f"{self.name}: block {block} is free; only a held block is cached.")
        self._cached.add(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def evict_all(self) -> list[int]:
        """Evict every unheld cached block (`LLM.reset_prefix_cache`); returns them."""
        gone = list(self._evictable)
        self._evict(gone)
        return gone

    def _evict(self, blocks: list[int]) -> None:
        for b in blocks:
            del self._evictable[b]
            self._cached.discard(b)
        if blocks and self.on_evict is not None:
            self.on_evict(blocks)
        self._free.extend(reversed(blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with reference count 1, or `BlockPoolExhausted` (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise BlockPoolExhausted(
                f"{self.name}: {n} blocks wanted, {self.num_free} free of {self.num_usable}."
            )
        short = n - len(self._free)
        if short > 0:  # the least recently used cached blocks make up the rest
            self._evict(list(itertools.islice(self._evictable, short)))
        ids = self._free[len(self._free) - n :][::-1] if n else []
        del self._free[len(self._free) - n :]
        for b in ids:
            self._ref[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        for b in ids:
            self._check(b)
            if self._ref[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"{self.name}: block {b} is free; it cannot be shared.")
                del self._evictable[b]  # a cache hit takes it back
            self._ref[b] += 1

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        released = []
        ref, n = self._ref, self.num_blocks
        try:
            for b in ids:
                if not 0 < b < n:
                    self._check(b)
                r = ref[b]
                if r == 0:
                    raise ValueError(f"{self.name}: block {b} freed twice.")
                ref[b] = r - 1
                if r == 1:
                    released.append(b)
        finally:  # blocks released before a bad id stay released (as one by one)
            cached = self._cached
            for b in released:
                if b in cached:
                    self._evictable[b] = None  # the most recently used, evicted last
            plain = [b for b in released if b not in cached] if cached else released
            self._free.extend(reversed(plain))  # handed out again in the order freed
        return released

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def _check(self, b: int) -> None:
        if not 0 < b < self.num_blocks:
            raise ValueError(
                f"{self.name}: block id {b} is not allocatable (1..{self.num_blocks - 1})."
            )
