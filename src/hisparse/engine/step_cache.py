"""The `DsaKVCache` a model sees during one engine step: per layer, the runtime's
`CacheHandle` seen through the step (a HiSparse prefill writes through the prefill staging
area and reads the staged cache; step hooks may replace the leader's top-k), and the indexer's
pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.staging import PrefillStaging

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner


class LayerView:
    """A step's view of one layer over its runtime handle: writes go straight through, or
    on a HiSparse prefill step into the step's staged cache (``staging``)."""

    def __init__(
        self, runner: ModelRunner, handle: CacheHandle, staging: PrefillStaging | None = None
    ) -> None:
        self.runner, self.handle, self.staging = runner, handle, staging
        self.staged: torch.Tensor | None = None

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.staging is None:
            return self.handle.write_target()
        self.staged = self.staging.stage(self.handle.runtime)
        return self.staged, self.staging.write_rows

    def finish_kv_update(self) -> None:
        if self.staging is None:
            self.handle.finish_kv_update()
            return
        assert self.staged is not None, "write_target first"
        self.handle.finish_staged_update(self.staged, self.staging.write_rows)


class PrefillLayerCache(LayerView):
    """A prefill step's view of one layer: HiSparse reads the step's staged cache, all-GPU
    the resident rows; records the leader's last-token top-k of requests that finish their
    prompt (for the warm start), which the step hooks may replace (`StepHooks.warm_topk`)."""

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        runner, rt = self.runner, self.handle.runtime
        if rt.is_leader and runner.warm is not None:
            logical_topk = runner.warm.record(rt.name, logical_topk)
        if self.staging is None:
            return self.handle.resident_rows(logical_topk)
        meta, _ = self.handle._step()
        return self.staging.logical_rows(logical_topk, meta.req_per_token)


class DecodeLayerCache(LayerView):
    """A decode step's view of one layer when the runner has step hooks: the runtime's
    handle, with the leader's logical top-k passed through `StepHooks.decode_topk`."""

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        rt = self.handle.runtime
        if rt.is_leader:
            logical_topk = self.runner.hooked_decode_topk(rt.name, logical_topk)
        return self.handle.swap_in(logical_topk)  # type: ignore[return-value]


class IndexerLayerCache:
    def __init__(self, pages: torch.Tensor, slots: torch.Tensor, table: torch.Tensor) -> None:
        self.pages, self.slots, self.table = pages, slots, table

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages, self.slots

    def read_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages, self.table


class StepCache:
    """The `DsaKVCache` the model sees during one step."""

    def __init__(
        self,
        runner: ModelRunner,
        decode: bool,
        idx_slots: torch.Tensor,
        idx_table: torch.Tensor,
        staging: PrefillStaging | None = None,
    ) -> None:
        self.runner, self.decode = runner, decode
        self.idx_slots, self.idx_table = idx_slots, idx_table
        self.staging = staging

    @property
    def row_format(self) -> object:
        return self.runner.row_format

    @property
    def indexer_format(self) -> object:
        return self.runner.model.indexer_format

    def attention(self, layer: int) -> CacheHandle | PrefillLayerCache | DecodeLayerCache:
        handle = self.runner.handles[layer]
        if not self.decode:
            return PrefillLayerCache(self.runner, handle, self.staging)
        if self.runner.hooks is None:
            return handle
        return DecodeLayerCache(self.runner, handle)

    def indexer(self, layer: int) -> IndexerLayerCache:
        pages = self.runner.indexer_pages[layer]
        return IndexerLayerCache(pages, self.idx_slots, self.idx_table)
