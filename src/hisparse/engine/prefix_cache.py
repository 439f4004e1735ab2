"""The block-level prefix cache (vLLM's scheme, docs/design.md §12.10): every full page of a
request is named by a chained hash of its token ids (and the page before it, and a key of
what else shapes the rows: the model, the row format, the indexer), registered once its rows
are complete, and found again by a later request whose tokens start the same way: it takes the
pages by reference and prefills only the rest.

What a cached page holds is one block of one pool: the host block under HiSparse (its rows and,
in a region of the same block, a copy of the page's indexer keys, which otherwise live only on
the GPU), the resident GPU block on all-GPU placement (every layer's page, indexer included).
The pool keeps a cached block that no request holds in an LRU list and evicts it when it needs
room (`hisparse.kv.block_pool.BlockPool`); the cache forgets its hash then (`evicted`).

Plain Python, no torch: the scheduler drives it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from hisparse.kv.block_pool import BlockPool


def page_hashes(
    token_ids: Sequence[int], block_size: int, key: bytes, parent: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full pages of ``token_ids``, which start a page after the
    one ``parent`` hashes (empty: they start the sequence, and page 0 chains from ``key``):
    a page's hash covers every token before its end."""
    out = []
    prev = parent or key
    for p in range(len(token_ids) // block_size):
        toks = token_ids[p * block_size : (p + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(struct.pack(f"<{len(toks)}q", *toks))
        prev = h.digest()
        out.append(prev)
    return out


class PrefixCache:
    """Page hash -> cached block of ``pool``, and back; the hit counters."""

    def __init__(self, pool: BlockPool, block_size: int, key: bytes) -> None:
        self.pool = pool
        self.block_size = block_size
        #: what besides the tokens shapes a page's rows (model, row format, indexer)
        self.key = key
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        pool.on_evict = self.evicted
        #: prompt tokens looked up, and of them the tokens found cached (`/metrics`)
        self.queries = 0
        self.hits = 0
        #: cached pages evicted to make room
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def hashes(
        self, known: list[bytes], num_pages: int, tokens: Callable[[int, int], list[int]]
    ) -> list[bytes]:
        """The hashes of a request's first ``num_pages`` pages, extending ``known`` (those
        computed before) in place; ``tokens(start, n)`` reads its tokens (only the new pages'
        are read: a long request's hashes grow page by page)."""
        if len(known) < num_pages:
            bs, start = self.block_size, len(known)
            parent = known[-1] if known else b""
            toks = tokens(start * bs, (num_pages - start) * bs)
            known.extend(page_hashes(toks, bs, self.key, parent))
        return known[:num_pages]

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached run of ``hashes`` from the first page."""
        blocks = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def register(self, h: bytes, block: int) -> bool:
        """Cache ``block`` (held by the caller, its rows complete) as page ``h``. False where
        ``h`` is cached already (in another block: the caller's stays its own)."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        self.pool.mark_cached(block)
        return True

    def evicted(self, blocks: list[int]) -> None:
        """The pool evicted ``blocks`` (no request held them): forget their pages."""
        for b in blocks:
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                self.evictions += 1

    def clear(self) -> int:
        """Evict every cached block no request holds (held ones stay cached until freed);
        returns how many went."""
        return len(self.pool.evict_all())

    def record_query(self, num_tokens: int, cached: int) -> None:
        self.queries += num_tokens
        self.hits += cached
