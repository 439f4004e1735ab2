"""The state an index group shares (`IndexGroupRuntime`): its leader resolves the step's
top-k once against the requests' hot buffers and issues the gathers of every layer of the group.

An index group is a leader layer (the one that computes the top-k) and the follower layers
that reuse its selection (`hisparse.runtime.sparse_layer.SparseLayerRuntime`). They share one
hot state per request (`hot_index`, `lru`) and one slot assignment; every layer keeps its own
host rows and hot rows. In a decode step the leader resolves residency once on the copy stream
and issues the gathers of every layer of the group, recording one ready event per layer, so the
followers' copies hide behind earlier compute. A group of one has no follower compute to hide
behind: it resolves and gathers on the compute stream, in program order
(`IndexGroupRuntime.inline_swap_in`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse.config import ResolvedHiSparseConfig
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.ops import has_capability, ops_for
from hisparse.runtime.ops.cpu.group_decode import CpuGroupDecode
from hisparse.runtime.streams import CopyStream

if TYPE_CHECKING:
    from hisparse.runtime.sparse_layer import SparseLayerRuntime


def prefix_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, or ``t`` itself when it has exactly ``n`` rows: no new view per layer."""
    return t if t.shape[0] == n else t[:n]


class IndexGroupRuntime:
    """Hot-buffer state and per-step outputs shared by one leader and its followers (the
    runtime side of an index group; its place in the pools is `kv.layout.IndexGroupLayout`).

    ``hot_index[s, h]`` is the host row held by hot slot ``h`` of state slot ``s`` (``-1``:
    empty); ``lru[s]`` orders the slots oldest first. Outputs of the last resolve (physical
    rows, swap lists) live in fixed buffers sized for ``max_num_reqs * max_query_len`` rows.
    """

    def __init__(
        self,
        config: ResolvedHiSparseConfig,
        *,
        max_num_reqs: int,
        device: torch.device,
        copy_stream: CopyStream | None = None,
        hot_slots: int | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.hot_slots = config.device_buffer_size if hot_slots is None else hot_slots
        self.row_capacity = max_num_reqs * config.max_query_len
        self.copy = copy_stream if copy_stream is not None else CopyStream(device)
        self.ops = ops_for(device)
        S, H, K = max_num_reqs, self.hot_slots, config.top_k
        i32 = dict(dtype=torch.int32, device=device)
        self.hot_index = torch.full((S, H), -1, **i32)
        self._lru_init = torch.arange(H, dtype=torch.int16, device=device)
        self.lru = self._lru_init.repeat(S, 1).contiguous()
        self.hot_block_table = torch.zeros((S, config.hot_blocks_per_request), **i32)
        self.physical = torch.full((self.row_capacity, K), -1, **i32)
        self.valid_counts = torch.zeros((self.row_capacity,), **i32)
        self.swap_src = torch.zeros((S, H), **i32)
        self.swap_dst = torch.zeros((S, H), **i32)
        self.swap_count = torch.zeros((S,), **i32)
        self.hit_miss = torch.zeros((S, 2), **i32)
        #: Running totals (hits, misses, rows swapped in), kept on the device: no sync per step.
        self.totals = torch.zeros((3,), dtype=torch.int64, device=device)
        #: ``(rows, k)`` -> (``physical[:rows, :k]``, ``valid_counts[:rows]``): the same views
        #: every step of a batch size, made once instead of per layer and step.
        self._out_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: list[SparseLayerRuntime] = []
        #: (host span, device views in span order) for the one-read group gather, ``None``
        #: where it does not apply; computed on first use after the views were (re)bound.
        self._span_gather: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._span_checked = False

    @property
    def ops(self) -> Any:
        """The data-plane ops namespace every op of the group goes through (`ops_for`)."""
        return self._ops

    @ops.setter
    def ops(self, ops: Any) -> None:
        self._ops = ops
        #: Batch-1 CPU decode steps may take the CPU backend's compiled path
        #: (`hisparse.runtime.ops.cpu.group_decode`), not ``ops``: set with the ops, so a
        #: wrapper that wants to see every op call (the swap timer) turns it off.
        fast = self.device.type == "cpu" and has_capability(ops, "CPU_DECODE_FAST_PATH")
        self.cpu_one = CpuGroupDecode(self) if fast else None

    @property
    def leader(self) -> SparseLayerRuntime:
        return self.layers[0]

    @property
    def inline_swap_in(self) -> bool:
        """Resolve and gather on the compute stream, in program order, without events.

        The CPU has no copy stream. A group of one on CUDA gains nothing from it: between
        issuing its gathers and waiting for them the compute stream has nothing to run (the
        attention needs the rows, no follower layer computes meanwhile), while the fork and
        join cost graph nodes, launch time and cross-stream latency in every layer.
        """
        return self.copy.stream is None or len(self.layers) == 1

    # --- state lifecycle -------------------------------------------------------------------
    def bind_hot_block_table(self, table: torch.Tensor) -> None:
        """Use ``table[s]`` (GPU block ids of slot ``s``'s hot region; shared by the hot group)."""
        expected = (self.max_num_reqs, self.config.hot_blocks_per_request)
        if tuple(table.shape) != expected or table.dtype != torch.int32:
            raise ValueError(f"hot block table must be int32 {expected}, got {tuple(table.shape)}")
        self.hot_block_table = table
        if self.cpu_one is not None:
            self.cpu_one.forget()

    def reset_slot(self, slot: int) -> None:
        """Forget slot ``slot``'s hot rows: a new request takes the slot."""
        self.copy.compute_waits_for_copies()
        self.hot_index[slot].fill_(-1)
        self.lru[slot].copy_(self._lru_init)

    def invalidate_written(
        self,
        meta: StepMetadata,
        num_rows: int | None = None,
        mirror: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Empty hot slots holding host rows this step (re)writes: no stale hit, ever.
        ``mirror=(device view, host view, device rows)``: the ops' `INVALIDATE_MIRRORS` copy
        of the written rows to the host in the same launch (the caller checked the flag)."""
        if meta.host_slot_mapping is None:
            return
        n = meta.num_tokens if num_rows is None else num_rows
        if n == 0:
            return
        if mirror is not None:
            self.ops.invalidate_written_slots(
                self.hot_index,
                meta.request_state_indices,
                prefix_rows(meta.req_per_token, n),
                prefix_rows(meta.host_slot_mapping, n),
                mirror=mirror,
            )
            return
        if n == 1 and self.cpu_one is not None and self.cpu_one.invalidate_one(meta):
            return
        self.ops.invalidate_written_slots(
            self.hot_index,
            meta.request_state_indices,
            prefix_rows(meta.req_per_token, n),
            prefix_rows(meta.host_slot_mapping, n),
        )

    # --- one step --------------------------------------------------------------------------
    def check_rows(self, topk: torch.Tensor) -> None:
        rows, k = topk.shape
        if rows > self.row_capacity:
            raise ValueError(
                f"HiSparse swap-in got {rows} query rows but is configured for "
                f"max_num_reqs * max_query_len = {self.max_num_reqs} * "
                f"{self.config.max_query_len} = {self.row_capacity}; raise "
                "HiSparseConfig.max_query_len (speculative tokens + 1) or max_num_seqs."
            )
        if k > self.config.top_k:
            raise ValueError(f"top-k width {k} exceeds the configured top_k {self.config.top_k}")
        if topk.dtype != torch.int32:
            raise TypeError(f"logical top-k indices must be int32, got {topk.dtype}")

    def out_views(self, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(``physical[:rows, :k]``, ``valid_counts[:rows]``): this step's output views."""
        views = self._out_views.get((rows, k))
        if views is None:
            views = (self.physical[:rows, :k], self.valid_counts[:rows])
            self._out_views[(rows, k)] = views
        return views

    def _resolve(
        self,
        meta: StepMetadata,
        resident_block_table: torch.Tensor | None,
        topk: torch.Tensor,
        max_rows_per_request: int | None,
        count: bool = False,
    ) -> None:
        """One resolve into the group's step buffers (physical rows, swap lists, counters);
        ``count``: add its hits and misses to `totals` (inside the resolve where the ops
        can, else `_count_step`)."""
        self.check_rows(topk)
        rows, k = topk.shape
        physical, valid_counts = self.out_views(rows, k)
        adds = count and has_capability(self.ops, "RESOLVE_ADDS_TOTALS")
        extra = dict(totals=self.totals, n_layers=len(self.layers)) if adds else {}
        self.ops.resolve_residency(
            topk,
            prefix_rows(meta.req_per_token, rows),
            meta.request_state_indices,
            meta.source_block_table,
            resident_block_table,
            self.hot_block_table,
            self.hot_index,
            self.lru,
            self.config.block_size,
            physical,
            self.swap_src,
            self.swap_dst,
            self.swap_count,
            valid_counts,
            self.hit_miss,
            max_rows_per_request=max_rows_per_request,
            **extra,
        )
        if count and not adds:
            self._count_step(meta.num_reqs)

    def resolve_resident(self, meta: StepMetadata, tables: GroupTables, topk: torch.Tensor) -> None:
        """Leader of an all-GPU group (every page resident, no host rows): the physical rows
        straight from the resident block table (`resident_rows`, one kernel), which is what
        a resolve finds there, without its hot state, swap lists or counters (the engine
        reports none for this placement); every layer of the group is then ready."""
        self.check_rows(topk)
        rows, k = topk.shape
        physical, valid_counts = self.out_views(rows, k)
        self.ops.resident_rows(
            topk, prefix_rows(meta.req_per_token, rows), tables.resident_block_table,
            self.config.block_size, physical, valid_counts,
        )  # fmt: skip
        for layer in self.layers:
            layer.mark_ready(on_compute=True)

    def _count_step(self, num_reqs: int) -> None:
        """Add the last resolve's hits and misses (and rows moved: misses x layers) to
        `totals`. On the CPU in numpy (three small torch ops cost more than the resolve's
        arithmetic); elsewhere on the device, without a sync."""
        if self.totals.is_cpu:
            hm = self.hit_miss.numpy()
            if num_reqs == 1:
                hits, misses = int(hm[0, 0]), int(hm[0, 1])
            else:
                hits, misses = (int(x) for x in hm[:num_reqs].sum(0, dtype=np.int64))
            totals = self.totals.numpy()
            totals[0] += hits
            totals[1] += misses
            totals[2] += misses * len(self.layers)
            return
        hm = self.hit_miss[:num_reqs].sum(0, dtype=torch.int64)
        self.totals[:2] += hm
        self.totals[2] += hm[1] * len(self.layers)

    def share_hit_miss(self, view: torch.Tensor) -> None:
        """Keep the per-request hits and misses in ``view`` (``[S, 2]`` int32, zeroed): the
        runner gives every group a view of one tensor, so a step's counts read them whole."""
        assert view.shape == self.hit_miss.shape and view.dtype == self.hit_miss.dtype
        self.hit_miss = view
        self.views_changed()

    def views_changed(self) -> None:
        """A layer (re)bound a view: re-check whether the group gather applies."""
        self._span_gather = None
        self._span_checked = False
        if self.cpu_one is not None:
            self.cpu_one.forget()

    def span_gather_views(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(token-major host span, device views in span order) if one read serves the group.

        Applies when the group has more than one layer, every layer's host view is one
        ``row_bytes`` slice of the same token-major span (same storage and shape, row stride
        ``G * row_bytes``, slices at consecutive offsets in some layer order), and the device
        views are pages of one GPU pool (same storage, shape and strides). Otherwise the
        leader gathers layer by layer. Checked once per binding, not per step.
        """
        if self._span_checked:
            return self._span_gather
        self._span_checked = True
        self._span_gather = None
        layers = self.layers
        G = len(layers)
        if G < 2 or any(ly.host_view is None or ly.device_view is None for ly in layers):
            return None
        hosts = [ly.host_view for ly in layers]
        devs = [ly.device_view for ly in layers]
        rb = layers[0].row_bytes
        h0, d0 = hosts[0], devs[0]
        for h, d, ly in zip(hosts, devs, layers, strict=True):
            assert h is not None and d is not None
            if ly.row_bytes != rb or h.shape != h0.shape or d.shape != d0.shape:
                return None
            if h.stride() != (h0.stride(0), G * rb, 1) or d.stride() != d0.stride():
                return None
            if h.untyped_storage().data_ptr() != h0.untyped_storage().data_ptr():
                return None
            if d.untyped_storage().data_ptr() != d0.untyped_storage().data_ptr():
                return None
        lo = min(h.data_ptr() for h in hosts)
        order = sorted(range(G), key=lambda i: hosts[i].data_ptr())
        if [hosts[i].data_ptr() - lo for i in order] != [j * rb for j in range(G)]:
            return None
        first = hosts[order[0]]
        span = first.as_strided(
            (first.shape[0], first.shape[1], G * rb),
            (first.stride(0), G * rb, 1),
            first.storage_offset(),
        )
        self._span_gather = (span, [devs[i] for i in order])  # type: ignore[misc]
        return self._span_gather

    def resolve_and_gather(
        self, meta: StepMetadata, tables: GroupTables, topk: torch.Tensor
    ) -> None:
        """Leader only: resolve once, then gather for this layer and (decode) every follower.

        In decode, a token-major group (`span_gather_views`) is gathered by one read of each
        missed token's whole span, and every layer's event waits for it: fewer, longer reads
        (docs/design.md §10: longer spans move faster than single rows). Reading the leader's
        rows first, so its attention could start earlier, measured slower and was removed.
        """
        if self.inline_swap_in:
            self._resolve_and_gather_here(meta, tables, topk)
            return
        self.copy.wait_for_compute()
        with self.copy.active():
            self._resolve_and_gather_here(meta, tables, topk)

    def _resolve_and_gather_here(
        self, meta: StepMetadata, tables: GroupTables, topk: torch.Tensor
    ) -> None:
        """The body of `resolve_and_gather`, on whatever stream is current."""
        if self.cpu_one is not None and self.cpu_one.decode_one(meta, tables, topk):
            return
        self._resolve(
            meta, tables.resident_block_table, topk, self.config.max_query_len, count=True
        )
        span = self.span_gather_views() if meta.is_decode else None
        if span is not None:
            host_span, devices = span
            self.ops.gather_compact_group(
                host_span, devices, self.swap_src, self.swap_dst, self.swap_count
            )
            for layer in self.layers:
                layer.mark_ready()
            return
        for layer in self.layers if meta.is_decode else self.layers[:1]:
            layer.gather_swapped_rows()

    def warm_start_from_host(self, meta: StepMetadata, topk: torch.Tensor) -> None:
        """Fill hot slots from the host pool with a finished prefill's last selection: a
        resolve as if nothing were resident (every selected row gets a hot slot), then every
        layer's rows gathered from the host as a decode step gathers its misses. The engine's
        HiSparse prefill streams its pages to the host as chunks finish (docs/design.md §5.3),
        so the rows are there rather than on resident pages. Not counted as hits or misses."""
        self.copy.wait_for_compute()
        with self.copy.active():
            self._resolve(meta, None, topk, None)
            span = self.span_gather_views()
            if span is not None:
                host_span, devices = span
                self.ops.gather_compact_group(
                    host_span, devices, self.swap_src, self.swap_dst, self.swap_count
                )
            else:
                for layer in self.layers:
                    if layer.host_view is not None:
                        self.ops.gather_compact(
                            layer.host_view,
                            layer.device_view,
                            self.swap_src,
                            self.swap_dst,
                            self.swap_count,
                        )
        self.copy.compute_waits_for_copies()
