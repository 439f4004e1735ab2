"""When a HiSparse request's older pages leave the GPU (`HiSparseConfig.offload`, docs/design.md
§12.3.1), decided in one place that the block accounting and the scheduler both ask.

``"always"``: a HiSparse request keeps only its tail pages resident; every older row is read
from the host through its hot buffer. ``"under_pressure"`` (the default): the pages a step
writes stay resident while the GPU pool has room, so a request reads them in place like the
all-GPU placement; when the pool is needed, the scheduler demotes the request holding the most
such pages (its older pages go to the host and it reads through its hot buffer from then on).
All-GPU placement keeps every page resident and never offloads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from hisparse.config import cdiv
from hisparse.kv.layout import RESIDENT_TAIL_PAGES

T = TypeVar("T")


class OffloadPolicy:
    """The decisions of the offload policy over a request's page sets (plain Python)."""

    def __init__(self, placement: str, offload: str, block_size: int) -> None:
        #: the HiSparse placement (host pool + hot buffers)
        self.hisparse = placement == "hisparse"
        #: HiSparse with ``offload="under_pressure"``: written pages stay resident while the
        #: pool has room
        self.under_pressure = self.hisparse and offload == "under_pressure"
        self.block_size = block_size

    def first_resident_page(
        self,
        pages: int,
        indexed_pages: int,
        blocks_from: Callable[[int], int],
        room: int,
        keep_all: bool | None = None,
        shared_pages: int = 0,
    ) -> int:
        """The first page a growth to ``pages`` pages makes resident (every missing page from
        it on). ``keep_all`` (default: all-GPU placement): from page 0. HiSparse: the last page
        only (the older ones live on the host); under pressure every page the step writes
        (from the one holding its first new token, ``indexed_pages - 1``) where
        ``blocks_from(first)`` blocks fit in ``room``, and before them a prefix-cache hit's
        ``shared_pages`` (its first growth; filled from their host blocks) where those fit
        too: the request then reads its whole context in place, as one that prefilled it."""
        if keep_all if keep_all is not None else not self.hisparse:
            return 0
        if self.under_pressure:
            if shared_pages and blocks_from(0) <= room:
                return 0
            first = max(indexed_pages - 1, 0)
            if blocks_from(first) <= room:
                return first
        return max(pages - 1, 0)

    def trims(self, demote: bool = False) -> bool:
        """Whether pages past the tail leave the GPU: after every step under ``"always"``,
        only to ``demote`` a request under ``"under_pressure"``, never on all-GPU."""
        return self.hisparse and (demote or not self.under_pressure)

    def keep_from(self, num_tokens: int) -> int:
        """The first page of a request of ``num_tokens`` tokens that stays resident when its
        older pages leave (its tail)."""
        return max(cdiv(num_tokens, self.block_size) - RESIDENT_TAIL_PAGES, 0)

    def reclaimable(self, resident: Sequence[dict[int, int]], indexed_pages: int, n: int) -> int:
        """GPU blocks a demotion of a request of ``n`` tokens would free: its resident pages
        older than the tail (0 unless ``"under_pressure"`` kept them). Every resident page
        less those from the tail on (pages this step grew included: all below the indexer's
        page count): O(tail + step), not O(context), as the scheduler asks for every request
        at every step."""
        if not self.under_pressure:
            return 0
        keep_from = self.keep_from(n)
        return sum(
            len(res) - sum(1 for p in range(keep_from, indexed_pages) if p in res)
            for res in resident
        )

    def all_resident(self, resident: Sequence[dict[int, int]], indexed_pages: int) -> bool:
        """A request still holds every page resident in every resident group (never demoted):
        its step reads no row through a hot buffer (`StepMetadata.all_resident`). Its resident
        pages are distinct pages below its indexer page count, so counting them is enough."""
        return self.under_pressure and all(len(res) >= indexed_pages for res in resident)

    def needs_warm_start(self, resident: Sequence[dict[int, int]], num_tokens: int) -> bool:
        """A HiSparse request that finished its prompt reads rows through its hot buffer,
        which the warm start seeds: not so where ``"under_pressure"`` kept every page."""
        if not self.hisparse:
            return False
        pages = cdiv(num_tokens, self.block_size)
        return not (self.under_pressure and all(len(r) >= pages for r in resident))

    def demotion_victim(self, candidates: Sequence[tuple[T, int]]) -> T | None:
        """Of ``(request, reclaimable blocks)``, the request to demote: the one holding the
        most pages a demotion frees (the first such in admission order); ``None`` where none
        holds any."""
        if not self.under_pressure or not candidates:
            return None
        best, blocks = max(candidates, key=lambda c: c[1])
        return best if blocks > 0 else None
