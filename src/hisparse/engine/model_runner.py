"""Runs one engine step of a DSA model over the HiSparse runtime (or all-GPU placement).

The runner builds the step's metadata once (token positions, block tables, write slots), binds
it to every index group's leader, and hands the model a `DsaKVCache` whose per-layer caches are
the runtime's `CacheHandle`s. Prefill keeps every page of the prefilling requests resident, so
its top-k maps through the resident table; a decode step resolves against the hot buffers and
swaps misses in. After a request's last prefill chunk its hot buffers are warmed from the
prefill's last-token selection, then its resident pages shrink to the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.config import ResolvedHiSparseConfig
from hisparse.engine.kv_manager import KVCacheManager
from hisparse.engine.request import Request
from hisparse.kv.row_formats import mla_row_bytes
from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat
from hisparse.models.deepseek_v32 import DsaForCausalLM
from hisparse.models.kv_access import DsaStep
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.runtime import SparseLayerRuntime
from hisparse.runtime.streams import CopyStream

_ROW_FORMAT_ENUM = {"fp8_ds_mla": RowFormat.FP8_DS_MLA, "bf16": RowFormat.BF16_MLA}


def engine_specs(
    model: torch.nn.Module, row_format: object, block_size: int
) -> list[LayerCacheSpec]:
    """Cache specs of ``model`` with the row sizes it really writes.

    DSA models: MLA rows (any row format, fp32 included) and an indexer cache on every full
    indexer layer; IndexShare followers name their leader. GQA models (Llama): K+V rows and
    a compact key cache on every layer (index groups of one).
    """
    specs: list[LayerCacheSpec] = []
    idx_row = model.indexer_format.row_bytes  # type: ignore[union-attr]
    if isinstance(model, DsaForCausalLM):
        cfg = model.config
        row = mla_row_bytes(row_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim)  # type: ignore[arg-type]
        fmt = _ROW_FORMAT_ENUM.get(str(row_format))
        full_layers = list(cfg.indexer_full)
    else:
        row = row_format.row_bytes  # type: ignore[attr-defined]
        fmt = RowFormat.GQA
        full_layers = [True] * model.config.num_hidden_layers  # type: ignore[union-attr]
    leader = ""
    for i, full in enumerate(full_layers):
        name = f"layers.{i}.attn"
        leader = name if full else leader
        specs.append(LayerCacheSpec(name, CacheKind.SPARSE_MLA, row, block_size, fmt, leader))
        if full:
            specs.append(
                LayerCacheSpec(f"layers.{i}.indexer", CacheKind.INDEXER, idx_row, block_size)
            )
    return specs


@dataclass
class StepResult:
    """Logits of the rows that sample (one per request whose step ends at a new token)."""

    logits: torch.Tensor
    sample_reqs: list[Request]


class _PrefillLayerCache:
    """A prefill step's view of one layer: resident rows only; records the leader's
    last-token top-k of requests that finish their prompt (for the warm start)."""

    def __init__(self, runner: ModelRunner, handle: CacheHandle) -> None:
        self.runner, self.handle = runner, handle

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.handle.write_target()

    def finish_kv_update(self) -> None:
        self.handle.finish_kv_update()

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        if self.handle.runtime.is_leader and self.runner.warm_rows is not None:
            self.runner.warm_topk[self.handle.runtime.name] = logical_topk[
                self.runner.warm_rows
            ].clone()
        return self.handle.resident_rows(logical_topk)


class _IndexerLayerCache:
    def __init__(self, pages: torch.Tensor, slots: torch.Tensor, table: torch.Tensor) -> None:
        self.pages, self.slots, self.table = pages, slots, table

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages, self.slots

    def read_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages, self.table


class _StepCache:
    """The `DsaKVCache` the model sees during one step."""

    def __init__(self, runner: ModelRunner, decode: bool, idx_slots: torch.Tensor,
                 idx_table: torch.Tensor) -> None:
        self.runner, self.decode = runner, decode
        self.idx_slots, self.idx_table = idx_slots, idx_table

    @property
    def row_format(self) -> object:
        return self.runner.row_format

    @property
    def indexer_format(self) -> object:
        return self.runner.model.indexer_format

    def attention(self, layer: int) -> CacheHandle | _PrefillLayerCache:
        handle = self.runner.handles[layer]
        return handle if self.decode else _PrefillLayerCache(self.runner, handle)

    def indexer(self, layer: int) -> _IndexerLayerCache:
        pages = self.runner.indexer_pages[layer]
        return _IndexerLayerCache(pages, self.idx_slots, self.idx_table)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ResolvedHiSparseConfig,
        kv: KVCacheManager,
        specs: list[LayerCacheSpec],
        *,
        row_format: object,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model, self.config, self.kv = model, config, kv
        self.row_format = row_format
        self.device = device
        self.max_num_seqs = max_num_seqs
        copy = CopyStream(device)
        self.runtimes: list[SparseLayerRuntime] = []
        self.handles: list[CacheHandle] = []
        self.leaders: list[CacheHandle] = []
        group_handles: list[list[CacheHandle]] = []
        for spec in (s for s in specs if s.kind is CacheKind.SPARSE_MLA):
            lead = spec.is_index_group_leader
            rt = SparseLayerRuntime(
                spec.name, config, row_bytes=spec.row_bytes, max_num_reqs=max_num_seqs,
                device=device, index_group=None if lead else self.runtimes[-1].group,
                copy_stream=copy, offload=kv.offload,
            )
            rt.bind_device(kv.gpu_view(spec.name))
            if kv.offload:
                rt.bind_host(kv.host_view(spec.name))
            handle = CacheHandle(rt)
            self.runtimes.append(rt)
            self.handles.append(handle)
            if lead:
                self.leaders.append(handle)
                group_handles.append([handle])
                if kv.offload:
                    rt.group.bind_hot_block_table(kv.hot_block_tables[kv.group_of_layer[spec.name]])
            else:
                group_handles[-1].append(handle)
        for hs in group_handles:
            CacheHandle.link_index_group(hs)
        #: layer index -> that layer's indexer pages ``[blocks, block_size * row_bytes]``
        self.indexer_pages = {
            int(s.name.split(".")[1]): kv.gpu_pages(s.name)
            for s in specs
            if s.kind is CacheKind.INDEXER
        }
        self.warm_rows: torch.Tensor | None = None
        self.warm_topk: dict[str, torch.Tensor] = {}

    def reset_slot(self, slot: int) -> None:
        for leader in self.leaders:
            leader.runtime.group.reset_slot(slot)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self, batch: list[tuple[Request, int]], *, decode: bool, finishing: list[bool]
    ) -> StepResult:
        """Forward ``batch`` (request, new tokens); logits for requests that sample now."""
        kv, bs, dev = self.kv, self.config.block_size, self.device
        while kv.pending_slot_resets:
            self.reset_slot(kv.pending_slot_resets.pop())
        ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        for r, (req, n) in enumerate(batch):
            start = req.num_computed
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            req_index.extend([r] * n)
            seq_lens.append(start + n)
            last_rows.append(len(ids) - 1)
        req_ids = [req.req_id for req, _ in batch]
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        rix = torch.tensor(req_index, dtype=torch.int64, device=dev)
        step = DsaStep(positions=pos, req_index=rix,
                       seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev))

        def rows_of(table: torch.Tensor) -> torch.Tensor:
            blk = table.long()[rix, pos // bs]
            return torch.where(blk > 0, blk * bs + pos % bs, -1).to(torch.int32)

        host_bt = kv.block_table(req_ids, "host") if kv.offload else torch.zeros(
            (len(batch), kv.max_blocks), dtype=torch.int32, device=dev)
        idx_table = kv.block_table(req_ids, "indexer")
        slots = torch.tensor(
            [kv.requests[rid].slot if decode else -1 for rid in req_ids],
            dtype=torch.int32, device=dev,
        )
        meta = StepMetadata(
            num_tokens=len(ids), is_decode=decode, req_per_token=rix.to(torch.int32),
            request_state_indices=slots, source_block_table=host_bt,
            host_slot_mapping=rows_of(host_bt) if kv.offload else None,
        )
        tables = []
        for gi in range(len(kv.resident_groups)):
            res_bt = kv.block_table(req_ids, "resident", gi)
            tables.append(GroupTables(resident_block_table=res_bt, slot_mapping=rows_of(res_bt)))
        for leader in self.leaders:
            leader.prepare_group_for_batch(meta, tables[kv.group_of_layer[leader.runtime.name]])

        warm = [r for r, f in enumerate(finishing) if f] if not decode and kv.offload else []
        self.warm_rows = (
            torch.tensor([last_rows[r] for r in warm], device=dev) if warm else None
        )
        self.warm_topk = {}
        cache = _StepCache(self, decode, rows_of(idx_table), idx_table)
        hidden = self.model(torch.tensor(ids, device=dev), step, cache)

        sample_rows = [last_rows[r] for r, f in enumerate(finishing) if f or decode]
        sample_reqs = [req for (req, _), f in zip(batch, finishing, strict=True) if f or decode]
        logits = self.model.logits(hidden[torch.tensor(sample_rows, device=dev)])
        if warm:
            self._warm_start([batch[r][0] for r in warm], [r for r in warm], host_bt, tables)
        if decode:
            self._collect_hits(batch)
        return StepResult(logits=logits, sample_reqs=sample_reqs)

    def _warm_start(self, reqs: list[Request], rows: list[int], host_bt: torch.Tensor,
                    tables: list[GroupTables]) -> None:
        """Seed the hot buffers of requests that just finished their prompt."""
        dev = self.device
        m = len(reqs)
        pick = torch.tensor(rows, device=dev)
        meta = StepMetadata(
            num_tokens=m, is_decode=True,
            req_per_token=torch.arange(m, dtype=torch.int32, device=dev),
            request_state_indices=torch.tensor(
                [self.kv.requests[r.req_id].slot for r in reqs], dtype=torch.int32, device=dev),
            source_block_table=host_bt[pick],
        )
        for leader in self.leaders:
            name = leader.runtime.name
            topk = self.warm_topk.get(name)
            if topk is None:
                continue
            t = tables[self.kv.group_of_layer[name]]
            sub = GroupTables(resident_block_table=t.resident_block_table[pick],
                              slot_mapping=t.slot_mapping[:0])
            leader.runtime.group.warm_start(meta, sub, topk)

    def _collect_hits(self, batch: list[tuple[Request, int]]) -> None:
        if not self.kv.offload:
            return
        n = len(batch)
        hm = torch.stack([h.runtime.group.hit_miss[:n] for h in self.leaders]).sum(0).cpu()
        for (req, _), (hits, misses) in zip(batch, hm.tolist(), strict=True):
            req.metrics.hits += hits
            req.metrics.misses += misses

    def write_back(self, dropped: list[tuple[int, int, int]], req: Request) -> None:
        """Lazy mirroring: copy dirty resident pages to their host blocks before release."""
        if self.config.eager_host_mirror or not dropped:
            return
        kv, bs = self.kv, self.config.block_size
        host = kv.requests[req.req_id].host
        for gi, page, blk in dropped:
            src = torch.arange(blk * bs, (blk + 1) * bs, dtype=torch.int32, device=self.device)
            dst = torch.arange(host[page] * bs, (host[page] + 1) * bs, dtype=torch.int32,
                               device=self.device)
            mask = torch.ones(bs, dtype=torch.int32, device=self.device)
            for name in kv.resident_groups[gi].layers:
                rt = self.runtimes[int(name.split(".")[1])]
                if name.endswith(".attn"):
                    rt.group.ops.gather_plan(rt.device_view, rt.host_view, src, dst, mask)
