"""Block accounting for both placements, in plain Python: which host and GPU blocks every
request holds, admission's capacity figures, growth, trimming and demotion's bookkeeping.

HiSparse placement: every page of every request gets a host block (the full copy, mirrored
eagerly); on the GPU a request holds its indexer pages (several to a block: the indexer table
holds page ids, `KVLayout.indexer_pages_per_block`), its resident pages (the two tail pages,
three while a step opens a page: a prefill streams its older pages to the host as its chunks
finish, so it holds no more than its decode will) and a leased hot region per hot group and a
hot-state slot. `KVLayout.gpu_blocks_per_request` is that need, for the planner and the
scheduler alike. All-GPU placement: one resident group holds every page of every layer,
nothing on the host.

The scheduler drives this object and imports no torch: every block-table change is recorded
as a `TableUpdate` (plain data) that the scheduler hands to the runner with the step
(`SchedulerOutput.table_updates`), and the runner writes it into the device tables
(`KVCacheManager.apply_table_updates`) in the order it was made, before the step's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hisparse.config import ResolvedHiSparseConfig, cdiv
from hisparse.engine.offload_policy import OffloadPolicy
from hisparse.engine.prefix_cache import PrefixCache
from hisparse.kv.block_pool import BlockPool
from hisparse.kv.layout import DEFAULT_PREFILL_TOKENS, GroupKind, KVLayout
from hisparse.kv.planner import plan_kv_layout
from hisparse.kv.specs import LayerCacheSpec


class KVCapacityError(RuntimeError):
    """The pools cannot hold what a step needs; the scheduler preempts or waits."""


class TableUpdate(NamedTuple):
    """One change to the device block tables: ``op`` ``"pages"`` writes ``ids`` at ``pages``
    of slot ``slot``'s row of table ``table`` (an index into `KVCacheManager.table_stack`:
    the resident groups' tables, then the host and the indexer tables); ``"hot"`` writes slot
    ``slot``'s row of hot group ``table``'s hot block table; ``"clear"`` zeroes slot ``slot``
    in every table (a freed request)."""

    op: str
    table: int
    slot: int
    pages: Sequence[int]
    ids: list[int]


class IndexerCopy(NamedTuple):
    """Prefix caching under HiSparse: copy the indexer keys of indexer pages ``pages`` to the
    indexer region of host blocks ``host_blocks`` (``to_host``: a page being cached) or back
    (a cache hit restoring them into the request's own indexer pages)."""

    to_host: bool
    pages: list[int]
    host_blocks: list[int]


@dataclass
class WriteBack:
    """Copy GPU blocks ``blocks`` of resident group ``group`` to host blocks ``host_blocks``
    before the step's forward: resident pages leaving the GPU whose decode rows are not on
    the host yet (the lazy mirror, ``eager_host_mirror=False``); ``to_gpu``: the other way,
    a prefix-cache hit's shared pages made resident (`KVBlockManager.grow`)."""

    group: int
    blocks: list[int]
    host_blocks: list[int]
    to_gpu: bool = False


@dataclass
class RequestBlocks:
    """Blocks one request holds. Page ``p`` covers tokens ``[p * bs, (p + 1) * bs)``."""

    host: list[int] = field(default_factory=list)
    #: Indexer page ids (block-table entries): page ``i`` of GPU block ``b`` is
    #: ``b * pages_per_block + i`` (`KVLayout.indexer_pages_per_block`).
    indexer: list[int] = field(default_factory=list)
    #: GPU blocks holding the indexer pages, ``pages_per_block`` pages each.
    indexer_blocks: list[int] = field(default_factory=list)
    #: Per resident group: page index -> GPU block.
    resident: list[dict[int, int]] = field(default_factory=list)
    #: Per hot group: the leased hot region (empty while not decoding).
    hot: list[list[int]] = field(default_factory=list)
    #: Hot-state slot while decoding, else -1.
    slot: int = -1
    #: Host blocks promised at admission but not yet allocated.
    host_reserved: int = 0
    #: Pages with decode rows not yet on the host (the lazy mirror; `mark_written`).
    dirty: set[int] = field(default_factory=set)
    #: Page count the last `KVBlockManager.grow` completed (0 after resident pages were
    #: released): growing within it again has nothing to add.
    grown_pages: int = 0
    #: Leading pages taken from the prefix cache at admission (held by reference, never
    #: written: the request computes from the page after them).
    shared_pages: int = 0
    #: Leading pages registered in (or taken from) the prefix cache.
    cached_pages: int = 0
    #: HiSparse: shared pages whose indexer keys the next growth restores from the host.
    restore_pages: int = 0


class KVBlockManager:
    """Every request's blocks and the pools' free lists (no memory of its own: the device
    pools and tables are `KVCacheManager`'s)."""

    def __init__(
        self,
        specs: list[LayerCacheSpec],
        config: ResolvedHiSparseConfig,
        *,
        placement: str,
        gpu_budget_bytes: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int = DEFAULT_PREFILL_TOKENS,
        host_shards: int = 1,
        host_shard: int = 0,
        host_writer: bool = True,
        prefix_caching: bool = False,
        cache_key: bytes = b"",
    ) -> None:
        """``host_shards`` / ``host_shard``: rows sharded by KV head over the node's ranks
        (`plan_kv_layout`); ``host_writer`` False on the ranks that only read rows another
        rank mirrors (docs/design.md §18). ``prefix_caching``: full pages stay cached after
        their request, named by their tokens and ``cache_key`` (`PrefixCache`)."""
        self.config = config
        self.placement = placement
        self.hisparse = placement == "hisparse"
        self.block_size = config.block_size
        #: when older pages leave the GPU (`HiSparseConfig.offload`)
        self.policy = OffloadPolicy(placement, config.offload, config.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_blocks = cdiv(max_model_len, self.block_size)
        self.host_writer = host_writer
        self.layout: KVLayout = plan_kv_layout(
            specs,
            config,
            gpu_budget_bytes,
            max_model_len,
            placement,  # type: ignore[arg-type]
            host_shards=host_shards,
            host_shard=host_shard,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            host_indexer_copy=prefix_caching,
        )
        lay = self.layout
        self._need_by_pages: dict[int, int] = {}
        self.gpu_blocks = BlockPool(lay.gpu_num_blocks, "GPU block pool")
        self.host_blocks: BlockPool | None = None
        if self.hisparse:
            self.host_blocks = BlockPool(lay.host_num_blocks, "host block pool")
        self.resident_groups = list(lay.groups(GroupKind.RESIDENT))
        self.hot_groups = list(lay.groups(GroupKind.HOT))
        #: group index (into resident_groups) of each sparse layer
        self.group_of_layer = {
            name: gi for gi, g in enumerate(self.resident_groups) for name in g.layers
        }
        n_res = len(self.resident_groups)
        #: the host and indexer tables' places in the table stack (HiSparse only)
        self.host_table_index = n_res if self.hisparse else None
        self.indexer_table_index = n_res + 1 if self.hisparse else None
        self.free_slots = list(range(max_num_seqs))
        #: slots leased since the runner last reset hot state (a new request in an old slot)
        self.pending_slot_resets: list[int] = []
        #: block-table changes not yet handed to the runner, in the order they were made
        self.table_updates: list[TableUpdate] = []
        self.requests: dict[str, RequestBlocks] = {}
        #: the pool whose blocks hold cached pages: the host pool under HiSparse (rows and
        #: indexer keys), the GPU pool on all-GPU placement
        self.prefix_cache: PrefixCache | None = None
        if prefix_caching:
            pool = self.host_blocks if self.host_blocks is not None else self.gpu_blocks
            self.prefix_cache = PrefixCache(pool, self.block_size, cache_key)
        #: indexer key copies not yet handed to the runner, in the order they were made
        self.indexer_copies: list[IndexerCopy] = []
        #: A prefix-cache hit's shared pages made resident (`grow`): host blocks to GPU blocks.
        self.page_fills: list[WriteBack] = []

    def take_table_updates(self) -> tuple[list[TableUpdate], list[int]]:
        """The table changes and slot resets recorded since the last call (and forget them):
        what the next step's runner applies first."""
        updates, self.table_updates = self.table_updates, []
        resets, self.pending_slot_resets = self.pending_slot_resets, []
        return updates, resets

    def take_page_fills(self) -> list[WriteBack]:
        """The shared pages' fills since the last call (the runner copies them, host to GPU,
        before the step's forwards)."""
        fills, self.page_fills = self.page_fills, []
        return fills

    def take_indexer_copies(self) -> list[IndexerCopy]:
        """The indexer key copies recorded since the last call (and forget them)."""
        copies, self.indexer_copies = self.indexer_copies, []
        return copies

    # --- capacity ------------------------------------------------------------------------
    @property
    def indexer_in_resident(self) -> bool:
        """All-GPU placement keeps indexer pages in the (single) resident group."""
        return not self.hisparse

    def host_pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size) + 1  # + copy-on-write tail

    def host_available(self) -> int:
        if self.host_blocks is None:
            return 1 << 62
        reserved = sum(r.host_reserved for r in self.requests.values())
        return self.host_blocks.num_free - reserved

    def host_fits(self, total_tokens: int) -> bool:
        """`admit` would find host blocks for a request of ``total_tokens`` tokens."""
        return not self.hisparse or self.host_pages_for(total_tokens) <= self.host_available()

    def gpu_need(self, num_tokens: int) -> int:
        """GPU blocks a request of ``num_tokens`` tokens holds at its peak, prefilling or
        decoding: `KVLayout.gpu_blocks_per_request`, the plan's own figure (a function of the
        page count, remembered per count: the scheduler asks for every request each step)."""
        pages = cdiv(num_tokens, self.block_size)
        need = self._need_by_pages.get(pages)
        if need is None:
            need = self._need_by_pages[pages] = self.layout.gpu_blocks_per_request(num_tokens)
        return need

    def reserved_len(self, num_tokens: int, total_tokens: int) -> int:
        """The length whose `gpu_need` admission keeps in reserve for a request of
        ``num_tokens`` tokens now and ``total_tokens`` at most: one page more (at most the
        total). The page a decode opens at a page boundary (a tail page in every resident
        group, an indexer page) is then there when it comes, and a prompt admitted beside
        requests about to cross a boundary does not preempt them a step later. Further
        growth is optimistic (vLLM's admission): reserving every request's whole output up
        front would admit far fewer short requests than fit."""
        return min(total_tokens, num_tokens + self.block_size)

    def gpu_held(self, req_id: str) -> int:
        """GPU blocks request ``req_id`` holds now (indexer, resident and hot blocks)."""
        b = self.requests[req_id]
        held = len(b.indexer_blocks) + sum(len(r) for r in b.resident)
        return held + sum(len(h) for h in b.hot)

    def staging_rows(self, num_tokens: int) -> int:
        """Staging rows a prefill chunk ending at ``num_tokens`` takes (0 on "gpu")."""
        return num_tokens if self.hisparse else 0

    @property
    def staging_capacity(self) -> int:
        """Rows of the prefill staging area (`PrefillStaging`)."""
        return self.layout.staging_blocks * self.block_size

    def hot_lease_blocks(self) -> int:
        return len(self.hot_groups) * self.config.hot_blocks_per_request

    # --- lifecycle -----------------------------------------------------------------------
    def admit(self, req_id: str, total_tokens: int, cached: Sequence[int] = ()) -> RequestBlocks:
        """Register a request and reserve host blocks for every token it may ever hold.
        ``cached``: the blocks of its first pages found in the prefix cache
        (`PrefixCache.lookup`), taken by reference."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id} is already admitted")
        blocks = RequestBlocks(resident=[{} for _ in self.resident_groups])
        blocks.hot = [[] for _ in self.hot_groups]
        k = len(cached)
        if self.hisparse:
            need = self.host_pages_for(total_tokens)
            if need > self.host_available():
                raise KVCapacityError("host pool full")
            blocks.host_reserved = need - k
        if k:
            pool = self.host_blocks if self.host_blocks is not None else self.gpu_blocks
            pool.incref(cached)
            if self.hisparse:
                blocks.host = list(cached)
                blocks.restore_pages = k
            else:
                blocks.resident[0] = dict(enumerate(cached))
            blocks.shared_pages = blocks.cached_pages = k
        self.requests[req_id] = blocks
        return blocks

    def cache_pages(self, req_id: str, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Register the full pages of request ``req_id`` among its first ``num_tokens``
        (computed, accepted) tokens in the prefix cache, ``hashes`` their page hashes; returns
        the pages newly registered. Under HiSparse their indexer keys are copied to their
        host blocks (an `IndexerCopy`); a lazy mirror's dirty page must be written back by
        the caller (`clean_pages`)."""
        cache, b = self.prefix_cache, self.requests[req_id]
        if cache is None:
            return []
        full = min(num_tokens // self.block_size, len(hashes))
        if self.hisparse:
            full = min(full, len(b.host), len(b.indexer))
        new = []
        for p in range(b.cached_pages, full):
            blk = b.host[p] if self.hisparse else b.resident[0].get(p)
            if blk is not None and cache.register(hashes[p], blk):
                new.append(p)
        b.cached_pages = max(b.cached_pages, full)
        if new and self.hisparse and self.host_writer:
            self.indexer_copies.append(
                IndexerCopy(True, [b.indexer[p] for p in new], [b.host[p] for p in new])
            )
        return new

    def clean_pages(self, req_id: str, pages: list[int]) -> list[tuple[int, list[int], list[int]]]:
        """The resident blocks of ``pages`` whose rows a lazy mirror has not copied to the
        host yet, as ``(group, pages, blocks)``, now counted as clean: the caller writes them
        back (a `WriteBack`) before anything reads the host blocks."""
        b = self.requests[req_id]
        dirty = [p for p in pages if p in b.dirty]
        if not dirty:
            return []
        out = []
        for gi, res in enumerate(b.resident):
            held = [p for p in dirty if p in res]
            if held:
                out.append((gi, held, [res[p] for p in held]))
        b.dirty.difference_update(dirty)
        return out

    def needs_growth(self, req_id: str, new_len: int) -> bool:
        """Whether `grow` to ``new_len`` tokens may add anything (False: within the pages the
        last growth completed, a no-op)."""
        return cdiv(new_len, self.block_size) > self.requests[req_id].grown_pages

    def grow(
        self,
        req_id: str,
        new_len: int,
        *,
        keep_all_resident: bool | None = None,
        reserve: int = 0,
    ) -> None:
        """Make pages for tokens ``[0, new_len)`` exist (all-or-nothing on the GPU).

        Which pages become resident is the offload policy's (`OffloadPolicy.
        first_resident_page`: all of them with ``keep_all_resident``, the default of all-GPU
        placement; else the last page, or under pressure every page the step writes while the
        pool has room for them beside ``reserve`` blocks, what other requests are promised)."""
        b = self.requests[req_id]
        bs = self.block_size
        pages = cdiv(new_len, bs)
        if pages <= b.grown_pages and keep_all_resident is None:
            return  # a decode within its last page: most steps of most requests
        m = self.layout.indexer_pages_per_block
        idx_pages = 0 if self.indexer_in_resident else max(pages - len(b.indexer), 0)
        idx_new = cdiv(len(b.indexer) + idx_pages, m) - len(b.indexer_blocks)

        def wanted(first: int) -> list[list[int]]:
            return [
                [p for p in range(first, pages) if p not in b.resident[gi]]
                for gi in range(len(self.resident_groups))
            ]

        first = self.policy.first_resident_page(
            pages,
            # a cache hit's first step writes from the page after its shared pages on
            max(len(b.indexer), b.shared_pages + 1 if b.shared_pages else 0),
            lambda f: idx_new + sum(len(w) for w in wanted(f)),
            self.gpu_blocks.num_free - reserve,
            keep_all_resident,
            b.shared_pages if b.restore_pages else 0,  # a hit's first growth
        )
        wanted_resident = wanted(first)
        n_gpu = idx_new + sum(len(w) for w in wanted_resident)
        if n_gpu > self.gpu_blocks.num_free:
            raise KVCapacityError(f"GPU pool: {n_gpu} blocks wanted, {self.gpu_blocks.num_free}")
        if self.host_blocks is not None and pages > len(b.host):
            n = pages - len(b.host)
            new = self.host_blocks.allocate(n)
            self._write_span(self.host_table_index, b.slot, len(b.host), new)
            b.host.extend(new)
            b.host_reserved = max(b.host_reserved - n, 0)
        b.indexer_blocks.extend(self.gpu_blocks.allocate(idx_new))
        first_page = len(b.indexer)
        new = [
            b.indexer_blocks[p // m] * m + p % m for p in range(first_page, first_page + idx_pages)
        ]
        self._write_span(self.indexer_table_index, b.slot, first_page, new)
        b.indexer.extend(new)
        if b.restore_pages and len(b.indexer) >= b.restore_pages:
            k, b.restore_pages = b.restore_pages, 0
            self.indexer_copies.append(IndexerCopy(False, b.indexer[:k], b.host[:k]))
        for gi, want in enumerate(wanted_resident):
            new = self.gpu_blocks.allocate(len(want))
            for p, blk in zip(want, new, strict=True):
                b.resident[gi][p] = blk
            self._write_pages(gi, b.slot, want, new)
            shared = [(blk, p) for p, blk in zip(want, new, strict=True) if p < b.shared_pages]
            if shared:  # a hit's shared pages made resident: their rows from the host blocks
                fill = WriteBack(gi, [k for k, _ in shared], [b.host[p] for _, p in shared], True)
                self.page_fills.append(fill)
        b.grown_pages = pages

    def trim_resident(
        self, req_id: str, num_tokens: int, *, demote: bool = False
    ) -> list[tuple[int, list[int], list[int]]]:
        """HiSparse: the resident pages older than the tail, as ``(group, pages, blocks)`` per
        group, so the caller can write dirty rows back before `release_resident` frees them.
        Called after every step (prefill chunks too: their rows are on the host already);
        under ``offload="under_pressure"`` only to ``demote`` a request (`Scheduler`)."""
        if not self.policy.trims(demote):
            return []
        b = self.requests[req_id]
        keep_from = self.policy.keep_from(num_tokens)
        dropped = []
        for gi, res in enumerate(b.resident):
            old = [p for p in res if p < keep_from]
            if old:
                dropped.append((gi, old, [res[p] for p in old]))
        return dropped

    def mark_written(self, req_id: str, start: int, count: int) -> None:
        """A decode step wrote rows ``[start, start + count)`` to resident pages only (the
        lazy mirror: `eager_host_mirror=False`); their pages must reach the host before they
        are freed. A prefill mirrors every row itself."""
        if self.hisparse and not self.config.eager_host_mirror and count > 0:
            bs = self.block_size
            self.requests[req_id].dirty.update(range(start // bs, (start + count - 1) // bs + 1))

    def dirty_pages(
        self, req_id: str, dropped: list[tuple[int, list[int], list[int]]]
    ) -> list[tuple[int, list[int], list[int]]]:
        """The pages of ``dropped`` (`trim_resident`'s) whose rows are not on the host yet:
        what a lazy mirror writes back."""
        dirty = self.requests[req_id].dirty
        out = []
        for gi, pages, blocks in dropped:
            keep = [(p, blk) for p, blk in zip(pages, blocks, strict=True) if p in dirty]
            if keep:
                out.append((gi, [p for p, _ in keep], [blk for _, blk in keep]))
        return out

    def release_resident(
        self, req_id: str, dropped: list[tuple[int, list[int], list[int]]]
    ) -> None:
        """Free what `trim_resident` returned: one pool call and one table write per group."""
        b = self.requests[req_id]
        b.grown_pages = 0
        for gi, pages, blocks in dropped:
            b.dirty.difference_update(pages)
            res = b.resident[gi]
            for p in pages:
                del res[p]
            self.gpu_blocks.free(blocks)
            self._write_pages(gi, b.slot, pages, [0] * len(pages))

    def reclaimable(self, req_id: str, num_tokens: int) -> int:
        """GPU blocks `trim_resident` with ``demote`` would free (`OffloadPolicy.reclaimable`)."""
        b = self.requests[req_id]
        return self.policy.reclaimable(b.resident, len(b.indexer), num_tokens)

    def all_resident(self, req_ids: list[str]) -> bool:
        """Whether each of ``req_ids`` still has every page resident in every resident group
        (`OffloadPolicy.all_resident`): its step's top-k resolves as in the all-GPU placement
        (`StepMetadata.all_resident`)."""
        reqs = self.requests
        return all(
            self.policy.all_resident(reqs[r].resident, len(reqs[r].indexer)) for r in req_ids
        )

    def needs_warm_start(self, req_id: str, num_tokens: int) -> bool:
        """Whether a request that finished its ``num_tokens``-token prompt reads rows through a
        hot buffer the warm start must seed (`OffloadPolicy.needs_warm_start`)."""
        return self.policy.needs_warm_start(self.requests[req_id].resident, num_tokens)

    def lease_hot(self, req_id: str) -> int:
        """Give a request a hot-state slot and its hot regions (HiSparse) for decoding.

        Leased at admission, so a request that prefilled can always start decoding."""
        b = self.requests[req_id]
        if b.slot >= 0:
            return b.slot
        if not self.free_slots:
            raise KVCapacityError("no hot-state slot free")
        n = self.hot_lease_blocks()
        if n > self.gpu_blocks.num_free:
            raise KVCapacityError("GPU pool: no room for a hot region")
        b.slot = self.free_slots.pop(0)
        self.pending_slot_resets.append(b.slot)
        hb = self.config.hot_blocks_per_request
        for hi in range(len(self.hot_groups)):
            region = self.gpu_blocks.allocate(hb)
            b.hot[hi] = region
            self.table_updates.append(TableUpdate("hot", hi, b.slot, range(hb), region))
        # blocks taken before the slot (none in the engine's order: admit, lease, grow)
        self._write_span(self.host_table_index, b.slot, 0, b.host)
        self._write_span(self.indexer_table_index, b.slot, 0, b.indexer)
        for gi, res in enumerate(b.resident):
            self._write_pages(gi, b.slot, list(res), list(res.values()))
        return b.slot

    def free(self, req_id: str) -> None:
        b = self.requests.pop(req_id, None)
        if b is None:
            return
        if self.host_blocks is not None and b.host:
            self.host_blocks.free(b.host)
        self.gpu_blocks.free(b.indexer_blocks)
        for res in b.resident:
            self.gpu_blocks.free(res.values())
        for region in b.hot:
            self.gpu_blocks.free(region)
        if b.slot >= 0:
            self.table_updates.append(TableUpdate("clear", -1, b.slot, range(0), []))
            self.free_slots.append(b.slot)

    def _write_span(self, table: int | None, slot: int, start: int, ids: list[int]) -> None:
        """Record ``table[slot, start : start + len(ids)] = ids``."""
        if table is not None and slot >= 0 and ids:
            self.table_updates.append(
                TableUpdate("pages", table, slot, range(start, start + len(ids)), list(ids))
            )

    def _write_pages(self, table: int, slot: int, pages: list[int], ids: list[int]) -> None:
        """Record ``table[slot, pages] = ids``."""
        if slot >= 0 and pages:
            self.table_updates.append(TableUpdate("pages", table, slot, list(pages), list(ids)))
