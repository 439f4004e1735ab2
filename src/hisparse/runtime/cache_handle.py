"""The attention-facing handle of one sparse layer's cache.

An attention layer talks to HiSparse only through this: where to write the step's new KV rows
(`write_target`), the host mirror of those rows (`finish_kv_update`), the physical rows its
top-k resolves to (`swap_in`), and, for a HiSparse prefill, the mirror of rows written into
a staged cache (`finish_staged_update`, `hisparse.runtime.staging`). All-GPU placement is the
same handle with no host rows: every page is resident, so `swap_in` resolves to resident rows
and nothing is mirrored or gathered.
"""

from __future__ import annotations

import torch

from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.index_group import prefix_rows
from hisparse.runtime.ops import cpu_backend, has_capability
from hisparse.runtime.sparse_layer import SparseLayerRuntime


class CacheHandle:
    def __init__(self, runtime: SparseLayerRuntime) -> None:
        self.runtime = runtime
        self.meta: StepMetadata | None = None
        self.tables: GroupTables | None = None
        #: The handles of this layer's index group (leader first); set on the leader.
        self.index_group_handles: list[CacheHandle] = [self]

    @staticmethod
    def link_index_group(handles: list[CacheHandle]) -> None:
        """Tell the leader's handle about its followers' handles (same order as the group)."""
        leader = handles[0]
        if [h.runtime for h in handles] != leader.runtime.group.layers:
            raise ValueError("handles must list the index group's layers, leader first")
        leader.index_group_handles = list(handles)

    # --- per step --------------------------------------------------------------------------
    def prepare_group_for_batch(self, meta: StepMetadata, tables: GroupTables) -> None:
        """Leader: bind this step's metadata to every layer of the index group."""
        if not self.runtime.is_leader:
            raise RuntimeError(f"{self.runtime.name} is a follower; prepare its leader")
        for handle in self.index_group_handles:
            handle.meta = meta
            handle.tables = tables
            handle.runtime.staged = False

    def _step(self) -> tuple[StepMetadata, GroupTables]:
        if self.meta is None or self.tables is None:
            raise RuntimeError(f"{self.runtime.name}: prepare_group_for_batch was not called")
        return self.meta, self.tables

    @property
    def host_mirror_required(self) -> bool:
        meta, _ = self._step()
        return (
            self.runtime.host_view is not None
            and self.runtime.writes_host
            and meta.host_slot_mapping is not None
            and (not meta.is_decode or self.runtime.config.eager_host_mirror)
        )

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(paged GPU view, resident row of each new token): where this step's rows go."""
        meta, tables = self._step()
        assert self.runtime.device_view is not None, "device view not bound"
        return self.runtime.device_view, tables.slot_mapping[: meta.num_tokens]

    def finish_kv_update(self) -> None:
        """After the layer wrote its new rows: mirror them to the host, drop stale hot copies.

        Runs in every step that writes (under CUDA graphs too): skipping the mirror is how
        other implementations lost rows.
        """
        meta, tables = self._step()
        rt = self.runtime
        group = rt.group
        if (
            meta.num_tokens == 1
            and group.cpu_one is not None
            and group.cpu_one.finish_one(rt, meta, tables)
        ):
            return  # a batch-1 decode step on the CPU: one compiled call, same result
        leader = group.layers[0] is rt
        mirror = self.host_mirror_required
        n = meta.num_tokens
        if leader and mirror and meta.is_decode and has_capability(group.ops, "INVALIDATE_MIRRORS"):
            # One launch: the decode step's new rows to the host and out of the hot slots.
            dev_rows = prefix_rows(tables.slot_mapping, n)
            group.invalidate_written(meta, mirror=(rt.device_view, rt.host_view, dev_rows))
            return
        if leader:
            group.invalidate_written(meta)
        if not mirror:
            return
        assert meta.host_slot_mapping is not None
        host_rows = prefix_rows(meta.host_slot_mapping, n)
        dev_rows = prefix_rows(tables.slot_mapping, n)
        # No mask: the op copies where both rows are valid (the Triton kernel tests that
        # itself, two elementwise kernels fewer per layer and step).
        group.ops.gather_plan(rt.device_view, rt.host_view, dev_rows, host_rows, None)

    def finish_staged_update(self, staged: torch.Tensor, rows: torch.Tensor) -> None:
        """`finish_kv_update` of a HiSparse prefill that wrote its new rows into a staged
        cache (`PrefillStaging`) at ``rows``: the host mirror from there, and a copy into
        the resident pages for the tokens whose page is resident (the tail the request
        keeps; the other pages live on the host only)."""
        meta, tables = self._step()
        rt = self.runtime
        group = rt.group
        if group.layers[0] is rt:
            group.invalidate_written(meta)
        assert rt.host_view is not None and meta.host_slot_mapping is not None
        n = meta.num_tokens
        rows = prefix_rows(rows, n)
        if rt.writes_host:  # tensor parallelism: one rank mirrors MLA rows (design §18.3)
            group.ops.gather_plan(staged, rt.host_view, rows,
                                  prefix_rows(meta.host_slot_mapping, n), None)  # fmt: skip
        group.ops.gather_plan(staged, rt.device_view, rows, prefix_rows(tables.slot_mapping, n),
                              None)  # fmt: skip

    def swap_in(
        self, logical_topk: torch.Tensor, *, return_valid_counts: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Physical rows ``[R, K]`` for ``logical_topk`` (``-1`` kept), rows ready on the GPU.

        The leader resolves and issues the group's gathers; every layer then waits for its
        own rows only.
        """
        meta, tables = self._step()
        rt = self.runtime
        group = rt.group
        if group.layers[0] is rt:  # the leader (its resolve checks the rows)
            # The CPU (no copy stream) with the compiled batch-1 step first: what
            # `resolve_and_gather` would run, without its frames; declined: the general path.
            if (not rt.hisparse or meta.all_resident) and logical_topk.is_cuda:
                group.resolve_resident(meta, tables, logical_topk)
            elif not (
                group.copy.stream is None
                and group.cpu_one is not None
                and group.cpu_one.decode_one(meta, tables, logical_topk)
            ):
                group.resolve_and_gather(meta, tables, logical_topk)
        else:
            group.check_rows(logical_topk)
            if not meta.is_decode:
                rt.stage_own_rows()
        rt.wait_ready()
        physical, valid_counts = group.out_views(*logical_topk.shape)
        if return_valid_counts:
            return physical, valid_counts
        return physical

    def resident_rows(self, logical_topk: torch.Tensor) -> torch.Tensor:
        """Physical rows of ``logical_topk`` through the resident block table alone.

        For an all-GPU prefill: every page is resident, so its many query rows need no hot
        state and no swap. (A HiSparse prefill reads its staged cache instead,
        `PrefillStaging`: its pages stream to the host as chunks finish.)

        A page that is not resident would be attended as masked: the reference path (which
        may synchronise) refuses it.
        """
        meta, tables = self._step()
        bs = self.runtime.config.block_size
        rows = logical_topk.shape[0]
        if self.runtime.device.type == "cpu":
            physical = cpu_backend().resident_rows_compiled(
                logical_topk, meta.req_per_token[:rows], tables.resident_block_table, bs
            )
            if physical is not None:
                return physical
        physical = torch.empty(logical_topk.shape, dtype=torch.int32, device=logical_topk.device)
        req = meta.req_per_token[:rows]
        self.runtime.group.ops.resident_rows(
            logical_topk, req, tables.resident_block_table, bs, physical
        )
        if self.runtime.device.type == "cpu" and bool(
            ((logical_topk >= 0) & (req >= 0)[:, None] & (physical < 0)).any()
        ):
            raise RuntimeError(
                f"{self.runtime.name}: a prefill top-k entry lies on a page that is not "
                "resident: stage the prefill's pages (PrefillStaging) instead."
            )
        return physical
