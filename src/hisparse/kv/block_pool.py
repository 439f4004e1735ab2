"""Reference-counted block allocator shared by the host pool and the GPU block pool.

Block id 0 is the null block in both id spaces: a block table entry of 0 means "no page", so
it is never handed out. The free list is a stack: the most recently freed blocks are handed out
first (in the order they were freed), so repeated requests keep reusing the same memory. The
host pool is allocated lazily by the OS: reusing freed blocks last walked a large pool's
untouched pages one call after another (resident memory grew with every `generate`).
A fresh pool hands out blocks in ascending order.
"""

from __future__ import annotations

from collections.abc import Iterable

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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with reference count 1, or `BlockPoolExhausted` (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockPoolExhausted(
                f"{self.name}: {n} blocks wanted, {len(self._free)} free of {self.num_usable}."
            )
        ids = self._free[len(self._free) - n :][::-1] if n else []
        del self._free[len(self._free) - n :]
        for b in ids:
            self._ref[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        for b in ids:
            self._check(b)
            if self._ref[b] == 0:
                raise ValueError(f"{self.name}: block {b} is free; it cannot be shared.")
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
            self._free.extend(reversed(released))  # handed out again in the order freed
        return released

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def _check(self, b: int) -> None:
        if not 0 < b < self.num_blocks:
            raise ValueError(
                f"{self.name}: block id {b} is not allocatable (1..{self.num_blocks - 1})."
            )
