"""Packing a HiSparse GPU block: how many indexer pages one block holds, and which layers'
pages share a block (docs/design.md §4.2).

Every group of the GPU pool overlays the same blocks, so the block is as large as its largest
group's page; packing fills it so that little of any group's block is padding.
"""

from __future__ import annotations

from hisparse.config import ROW_ALIGNMENT_BYTES, cdiv
from hisparse.kv.specs import LayerCacheSpec

#: Most indexer pages per block `choose_packing` tries.
MAX_INDEXER_PAGES_PER_BLOCK = 512


def choose_packing(
    units: list[list[LayerCacheSpec]],
    indexers: list[LayerCacheSpec],
    regular: list[LayerCacheSpec],
    *,
    pages: int,
    hot_pages: int,
    tail_pages: int,
) -> tuple[int, list[list[LayerCacheSpec]], list[list[LayerCacheSpec]]]:
    """HiSparse GPU block: ``(m, packs of index groups, packs of regular layers)``.

    A block is ``m`` indexer pages (every indexer layer's page side by side, ``G`` bytes), so
    the indexer group pads nothing; index groups (never split) are packed into blocks of
    ``m * G`` bytes first fit, largest first (`pack`), and so are regular layers. Of every
    ``m`` whose block holds the largest unit, the one whose request of ``pages`` pages (its
    indexer pages, ``tail_pages`` per resident pack, ``hot_pages`` per hot pack, every regular
    page) takes the fewest bytes wins; the smallest such ``m`` on ties (docs/design.md §4.2).
    The block stays a multiple of `ROW_ALIGNMENT_BYTES`, so every row of every block stays
    aligned for the kernels' 16-byte accesses.
    """
    sub = sum(s.page_bytes for s in indexers)
    largest = max(
        [sum(s.page_bytes for s in u) for u in units] + [s.page_bytes for s in regular],
        default=0,
    )
    if sub == 0:  # no indexer (not a HiSparse layout the checks accept): the largest unit
        return 1, pack(units, largest), pack([[s] for s in regular], largest)
    tail = tail_pages
    best: tuple[int, int, list, list] | None = None
    for m in range(max(cdiv(largest, sub), 1), MAX_INDEXER_PAGES_PER_BLOCK + 1):
        block = m * sub
        if block % ROW_ALIGNMENT_BYTES:
            continue
        packs = pack(units, block)
        reg = pack([[s] for s in regular], block)
        nbytes = block * (cdiv(pages, m) + len(packs) * (tail + hot_pages) + len(reg) * pages)
        if best is None or nbytes < best[0]:
            best = (nbytes, m, packs, reg)
        if len(packs) <= 1 and len(reg) <= 1:
            break  # one pack holds everything: a larger block only pads the indexer
    assert best is not None
    return best[1], best[2], best[3]


def pack(units: list[list[LayerCacheSpec]], limit: int) -> list[list[LayerCacheSpec]]:
    """First fit, largest first: each unit (never split) goes into the first pack it fits in
    (``<= limit`` bytes of pages), units taken largest first (ties in layer order); a unit
    larger than ``limit`` is a pack of its own. Inside a pack units keep layer order, and
    packs are ordered by their first layer."""
    sizes = [sum(s.page_bytes for s in u) for u in units]
    packs: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(units)), key=lambda i: -sizes[i]):
        for k, (used, members) in enumerate(packs):
            if used + sizes[i] <= limit:
                packs[k] = (used + sizes[i], [*members, i])
                break
        else:
            packs.append((sizes[i], [i]))
    ordered = sorted((sorted(members) for _, members in packs), key=lambda m: m[0])
    return [[s for i in members for s in units[i]] for members in ordered]
