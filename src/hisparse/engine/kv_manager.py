"""The physical KV pools and device block tables of one engine, over `KVBlockManager`'s
accounting (`hisparse.engine.kv_blocks`).

Block tables live on the device, one row per hot-state slot (every admitted request holds a
slot). They change only when a request's blocks change (a new page, a dropped page, a freed
request): the accounting records each change and the runner applies them before the step's
forward (`apply_table_updates`). A step gathers its requests' rows with one index on the
device: no per-step Python over the context, which at 128K tokens (2048 pages) would dominate
a decode step. A prefill step reads its earlier tokens through the prefill staging buffer
(`staging_raw`, outside the block pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hisparse import envs
from hisparse.config import ResolvedHiSparseConfig
from hisparse.engine.host_copy import host_tensor, to_device
from hisparse.engine.kv_blocks import (
    IndexerCopy,
    KVBlockManager,
    KVCapacityError,
    RequestBlocks,
    TableUpdate,
)
from hisparse.kv.host_pool import HostPool
from hisparse.kv.layout import GroupKind
from hisparse.kv.specs import LayerCacheSpec

__all__ = ["KVCacheManager", "KVCapacityError", "RequestBlocks", "TableUpdate"]


def _poison(pool: torch.Tensor) -> None:
    """Fill ``pool`` with 0xFF (NaN in every float format), so that a read of a row nothing
    wrote shows up as NaN instead of passing as a plausible zero: always on a GPU (one memset),
    on the CPU only with ``HISPARSE_POISON=1`` (the test suite sets it). On the CPU the fill
    touches every page of the pool, so it cost seconds of start-up (3-4 s for the default
    1 GiB on a 2-core machine) and committed the whole pool's memory."""
    if pool.device.type != "cpu" or envs.value("HISPARSE_POISON"):
        pool.fill_(255)


class KVCacheManager(KVBlockManager):
    """`KVBlockManager` plus the GPU pool tensor, the host pool and the device tables."""

    def __init__(
        self,
        specs: list[LayerCacheSpec],
        config: ResolvedHiSparseConfig,
        *,
        device: torch.device,
        host_pool: Callable[[int, bool], HostPool] | None = None,
        **accounting: Any,
    ) -> None:
        """``accounting``: `KVBlockManager`'s arguments. ``host_pool(size, pin)`` makes the
        host pool (default: this process's own, `HostPool`); tensor parallelism passes the
        node's shared one (docs/design.md §18). ``device="meta"`` keeps the accounting only
        (no pool memory, no host pool)."""
        super().__init__(specs, config, **accounting)
        self.device = device
        self.host_pool: HostPool | None = None
        self._make_host_pool = host_pool or (lambda size, pin: HostPool(size, pin=pin))
        try:
            self._allocate(self.max_num_seqs, device)
        except BaseException:
            self.close()  # the process's one host pool: a later engine must get it
            raise

    def _allocate(self, max_num_seqs: int, device: torch.device) -> None:
        lay, config = self.layout, self.config
        self.gpu_raw = torch.empty(lay.gpu_pool_bytes, dtype=torch.uint8, device=device)
        _poison(self.gpu_raw)
        #: the prefill staging area (HiSparse; `PrefillStaging` views it one layer at a time)
        self.staging_raw = torch.empty(lay.staging_bytes, dtype=torch.uint8, device=device)
        _poison(self.staging_raw)
        if self.hisparse and device.type != "meta":
            self.host_pool = self._make_host_pool(lay.host_pool_bytes, device.type == "cuda")
        hb = config.hot_blocks_per_request
        #: per hot group: [max_num_seqs, hot blocks] GPU block ids of each slot's region
        self.hot_block_tables = [
            torch.zeros((max_num_seqs, hb), dtype=torch.int32, device=device)
            for _ in self.hot_groups
        ]
        S, MB, i32 = max_num_seqs, self.max_blocks, dict(dtype=torch.int32, device=device)
        n_res = len(self.resident_groups)
        #: Persistent ``[max_num_seqs, max_blocks]`` tables by slot (0 = no block), all views
        #: of one ``[tables, max_num_seqs, max_blocks]`` tensor: the resident groups' first,
        #: then (HiSparse) the host and indexer tables. A step gathers its rows of every table
        #: with one op (a table per layer group, 12 small kernels each, otherwise).
        self.table_stack = torch.zeros((n_res + (2 if self.hisparse else 0), S, MB), **i32)
        self.resident_tables = list(self.table_stack[:n_res].unbind(0))
        self.host_table = self.table_stack[n_res] if self.hisparse else None
        self.indexer_table = self.table_stack[n_res + 1] if self.hisparse else None

    # --- views ---------------------------------------------------------------------------
    def gpu_view(self, name: str) -> torch.Tensor:
        return self.layout.gpu_views[name].view(self.gpu_raw)

    def gpu_pages(self, name: str) -> torch.Tensor:
        return self.layout.gpu_views[name].page_view(self.gpu_raw)

    def host_view(self, name: str) -> torch.Tensor:
        assert self.host_pool is not None
        return self.layout.host_views[name].view(self.host_pool.backing)

    def close(self) -> None:
        """Release the host pool and the device tensors now (idempotent). Views of them held
        elsewhere (the runner's) keep device memory alive until they are dropped too."""
        if self.host_pool is not None:
            self.host_pool.close()
            self.host_pool = None
        for name in ("gpu_raw", "table_stack", "host_table", "indexer_table"):
            setattr(self, name, None)
        self.resident_tables, self.hot_block_tables = [], []
        self.requests = {}
        self.staging_raw = None

    def apply_table_updates(self, updates: Iterable[TableUpdate]) -> None:
        """Write recorded block-table changes into the device tables, in order (each a small
        host-to-device copy queued on the current stream; `engine/host_copy.py`)."""
        if self.table_stack is None or self.table_stack.is_meta:
            return
        for u in updates:
            if u.op == "clear":
                self.table_stack[:, u.slot] = 0
                for hot in self.hot_block_tables:
                    hot[u.slot] = 0
            elif u.op == "hot":
                table = self.hot_block_tables[u.table]
                table[u.slot].copy_(
                    host_tensor(u.ids, torch.int32, table.device), non_blocking=True
                )
            else:
                self._write_rows(self.table_stack[u.table], u.slot, list(u.pages), u.ids)

    def copy_indexer_pages(self, copies: Iterable[IndexerCopy]) -> None:
        """Prefix caching under HiSparse: copy whole indexer pages (every indexer layer's
        page: one span of the GPU pool) to their host blocks' indexer region, or back, in
        order. One asynchronous copy a page on the current stream, no host sync: a save runs
        after the step that wrote the keys, a restore after the save that wrote the host
        copy, and nothing on the host reads the pinned region in between."""
        copies = list(copies)
        if not copies or self.host_pool is None or self.gpu_raw is None:
            return
        lay = self.layout
        group = lay.groups(GroupKind.INDEXER)[0]
        m, page = group.pages_per_block, group.page_bytes
        stride = page if m > 1 else lay.gpu_bytes_per_block
        gpu = self.gpu_raw.as_strided((lay.gpu_num_blocks * m, page), (stride, 1))
        backing = self.host_pool.backing
        host = backing.as_strided(
            (lay.host_num_blocks, page),
            (lay.host_block_bytes, 1),
            backing.storage_offset() + lay.host_indexer_offset,
        )
        for c in copies:
            for page_row, block in zip(c.pages, c.host_blocks, strict=True):
                if c.to_host:
                    host[block].copy_(gpu[page_row], non_blocking=True)
                else:
                    gpu[page_row].copy_(host[block], non_blocking=True)

    def flush_table_updates(self) -> None:
        """Apply every change recorded so far (for callers outside the engine's step, such
        as tests that drive the accounting directly); slot resets stay for the runner."""
        updates, self.table_updates = self.table_updates, []
        self.apply_table_updates(updates)

    @staticmethod
    def _write_rows(table: torch.Tensor, slot: int, pages: list[int], ids: list[int]) -> None:
        if pages == list(range(pages[0], pages[0] + len(pages))):
            src = host_tensor(ids, torch.int32, table.device)
            table[slot, pages[0] : pages[0] + len(pages)].copy_(src, non_blocking=True)
        else:
            dev = table.device
            table[slot, to_device(pages, torch.long, dev)] = to_device(ids, torch.int32, dev)

    # --- block tables ---------------------------------------------------------------------
    def step_tables(
        self, slots: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        """(host, indexer, per resident group) ``[R, max_blocks]`` tables of the requests in
        slots ``slots`` (device int64): gathered on the device from the persistent tables.

        All-GPU placement has no host table (``None``) and reads indexer pages through the
        resident table (one block id addresses both)."""
        return self.split_stack(self.table_stack.index_select(1, slots))

    def split_stack(
        self, stack: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        """(host, indexer, per resident group) views of ``stack`` (``table_stack``'s layout)."""
        n_res = len(self.resident_tables)
        res = list(stack[:n_res].unbind(0))
        host = stack[n_res] if self.hisparse else None
        idx = stack[n_res + 1] if self.hisparse and not self.indexer_in_resident else res[0]
        return host, idx, res

    def block_table(self, req_ids: list[str], kind: str, group: int = 0) -> torch.Tensor:
        """``[R, max_blocks]`` int32 table: ``host``, ``indexer`` or ``resident`` (group).

        Built in Python from the block lists: the oracle the persistent tables are tested
        against; the runner uses `step_tables`."""
        out = torch.zeros((len(req_ids), self.max_blocks), dtype=torch.int32)
        for r, rid in enumerate(req_ids):
            b = self.requests[rid]
            if kind == "host":
                ids = b.host
                out[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            elif kind == "indexer" and not self.indexer_in_resident:
                out[r, : len(b.indexer)] = torch.tensor(b.indexer, dtype=torch.int32)
            else:
                res = b.resident[group]
                if res:
                    pages = torch.tensor(list(res.keys()))
                    out[r, pages] = torch.tensor(list(res.values()), dtype=torch.int32)
        return out.to(self.device)
