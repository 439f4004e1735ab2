"""The hot buffers' hits and misses without a GPU: the LRU of `resolve_residency`
(docs/design.md §6.2) on numpy arrays, one row per request, for a whole batch at once.

Only what decides hit counts is kept: which host row (here: the logical position, unique per
request) each hot slot holds, the slots' LRU order and, per request, the slot of each
position (a dense map, so a hit is one gather and no search). Physical rows are not
modelled. The order follows the reference exactly (evictable slots left unused, then the
slots just filled in assignment order, then the hit slots in their previous order), so hit
counts match the reference op step for step (tests/test_simulate.py checks it against
`runtime.ops.reference`).
"""

from __future__ import annotations

import numpy as np


class HotBuffers:
    """Hot state of ``slots`` requests with ``hot_rows`` slots each (one index group), for
    positions below ``max_len``."""

    def __init__(self, slots: int, hot_rows: int, max_len: int) -> None:
        if hot_rows > 32768:
            raise ValueError(f"{hot_rows} hot rows: the LRU orders at most 32,768")
        self.hot_rows = hot_rows
        #: hot[s, h]: the position slot h of request s holds, or -1
        self.hot = np.full((slots, hot_rows), -1, dtype=np.int64)
        #: lru[s]: s's slots, oldest first (the reference's ``lru``)
        self.lru = np.tile(np.arange(hot_rows, dtype=np.int64), (slots, 1))
        #: slot_of[s, p]: the slot holding position p, or -1
        self.slot_of = np.full((slots, max_len), -1, dtype=np.int16)

    def reset(self, slot: int) -> None:
        """A new request takes ``slot``: nothing is hot, the order is the initial one."""
        self.hot[slot] = -1
        self.lru[slot] = np.arange(self.hot_rows)
        self.slot_of[slot] = -1

    def step(self, slots: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Resolve one selection per request: ``wanted [B, K]`` positions (distinct per row,
        ``-1``: none; resident entries already dropped) of the requests in ``slots [B]``.
        Updates the state; returns hits ``[B]`` and misses ``[B]``."""
        B, K = wanted.shape
        H = self.hot_rows
        if B == 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z
        if K > H:
            raise ValueError(f"{K} wanted rows per request exceed the {H} hot slots")
        valid = wanted >= 0
        rows = np.broadcast_to(slots[:, None], wanted.shape)
        where = np.where(valid, self.slot_of[rows, np.maximum(wanted, 0)], -1).astype(np.int64)
        hit = where >= 0
        miss = valid & ~hit
        n_miss = miss.sum(1)
        slot_hit = np.zeros((B, H), dtype=bool)
        hr, hc = np.nonzero(hit)
        slot_hit[hr, where[hr, hc]] = True
        # along each LRU order: hit slots, the first n_miss evictable (filled), the rest
        lru = self.lru[slots]
        hit_along = np.take_along_axis(slot_hit, lru, axis=1)
        n_evictable_before = np.cumsum(~hit_along, axis=1)
        filled_along = ~hit_along & (n_evictable_before <= n_miss[:, None])
        cat = np.where(hit_along, 2, np.where(filled_along, 1, 0)).astype(np.int8)
        # the misses in wanted-set order take the filled slots in LRU order
        fr, fc = np.nonzero(filled_along)  # row-major: each row's filled slots, oldest first
        targets = lru[fr, fc]
        mr, mc = np.nonzero(miss)  # row-major: each row's misses in wanted order
        new_pos = wanted[mr, mc]
        srow = slots[fr]
        old = self.hot[srow, targets]
        gone = old >= 0
        self.slot_of[srow[gone], old[gone]] = -1
        self.slot_of[srow, new_pos] = targets
        self.hot[srow, targets] = new_pos
        order = np.argsort(cat, axis=1, kind="stable")
        self.lru[slots] = np.take_along_axis(lru, order, axis=1)
        return hit.sum(1), n_miss
