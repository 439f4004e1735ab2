"""The `V4Cache` a DeepSeek-V4 model sees during one engine step (all-GPU placement).

Each layer's rows live in its sparse cache's pool as `v4_cache.row_layout` rows (window row,
and the entries at the row of their window's last token), found through the step's resident
block tables like every other model's rows; the compressors' carried state lives per request
slot (`v4_cache.SlotState`). HiSparse placement of these layers is not built (issue #57):
`LLM` refuses it for DeepSeek-V4.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hisparse.attention.dispatch import v4_attention
from hisparse.engine.hooks import StepHooks
from hisparse.models.registry import V4_KV_FORMATS
from hisparse.models.v4_cache import SlotState, row_layout, row_values
from hisparse.validation import _fail, check_choice

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner


class V4StepCache:
    """Row-addressed reads and writes of one step over the runner's pools (module docstring)."""

    def __init__(self, runner: ModelRunner, state: SlotState) -> None:
        self.runner, self.state = runner, state
        self.config = runner.model.config
        self.block_size = runner.config.block_size
        self.slots = runner.step_requests().slots  # engine slot of each request row
        self._rows: dict[int, torch.Tensor] = {}

    def _pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pages as ``[blocks, block_size, row values]`` of the model dtype
        (a view: the pool may interleave layers, so it is indexed, never reshaped)."""
        rows = self._rows.get(layer)
        if rows is None:
            view = self.runner.handles[layer].runtime.device_view
            assert view is not None, "device view not bound"
            rows = view.view(self.runner.model.head.weight.dtype)
            assert rows.shape[-1] == row_values(self.config, layer)
            self._rows[layer] = rows
        return rows

    def _physical(
        self, layer: int, req_row: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in the block) of each request row's position ``pos``; padding rows
        (``req_row < 0``) and ``pos < 0`` (a write to skip) land in the null block 0, which
        no valid read names."""
        _, tables = self.runner.handles[layer]._step()
        bs = self.block_size
        p = pos.clamp(min=0).long()
        r = req_row.long().expand(p.shape)
        blk = tables.resident_block_table[r.clamp(min=0), p // bs].long()
        blk = torch.where((r >= 0) & (pos >= 0), blk, 0)
        return blk, torch.where(pos >= 0, p % bs, 0)

    def _slot(self, req_row: torch.Tensor) -> torch.Tensor:
        """The state slot of each request row (padding: the spare slot, the last)."""
        r = req_row.long()
        return torch.where(r >= 0, self.slots[r.clamp(min=0)], self.state.spare)

    def _logical(self, layer: int, store: str, pos: torch.Tensor) -> torch.Tensor:
        """The token position whose row holds ``store``'s row ``pos``."""
        if store == "window":
            return pos
        rate = self.config.compress_rate(layer)
        return torch.where(pos >= 0, pos * rate + rate - 1, pos)

    def write(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor, values: torch.Tensor
    ) -> None:
        if store.startswith("state."):
            t = self.state.stores[(layer, store)]
            t[self._slot(req_row), pos.long()] = values.to(t.dtype)
            return
        first, width = row_layout(self.config, layer)[store]
        blk, off = self._physical(layer, req_row, self._logical(layer, store, pos))
        pool = self._pool(layer)
        pool[blk, off, first : first + width] = values.to(pool.dtype)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        req: torch.Tensor,
        window: torch.Tensor,
        entries: torch.Tensor | None,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """V4 attention of ``q [N, H, D]`` over its window rows ``window [N, W]`` and entries
        ``entries [N, E]`` (positions; ``-1`` none), read where they sit in the pool
        (`attention.dispatch.v4_attention`: the Triton kernel on CUDA)."""
        bs = self.block_size

        def rows(store: str, pos: torch.Tensor) -> torch.Tensor:
            blk, off = self._physical(layer, req[:, None], self._logical(layer, store, pos))
            return torch.where(pos >= 0, blk * bs + off, -1)

        idx = rows("window", window)
        if entries is not None:
            idx = torch.cat((idx, rows("entries.compressor", entries)), dim=1)
        entry_col, _ = row_layout(self.config, layer).get("entries.compressor", (0, 0))
        pool = self._pool(layer)
        return v4_attention(q, pool, idx, window.shape[1], entry_col, sinks, scale)

    def read(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        if store.startswith("state."):
            t = self.state.stores[(layer, store)]
            slot = self._slot(req_row).expand(pos.shape)
            out = t[slot, pos.clamp(min=0).long()]
        else:
            first, width = row_layout(self.config, layer)[store]
            blk, off = self._physical(layer, req_row, self._logical(layer, store, pos))
            out = self._pool(layer)[blk, off, first : first + width]
        return out.masked_fill((pos < 0).unsqueeze(-1), 0)


def check_v4_arguments(args: dict[str, Any]) -> bool:
    """True, or a `HiSparseConfigError` for an `LLM` argument (``args``: all of them by name)
    that a DeepSeek-V4 checkpoint does not run with yet: HiSparse placement of its compressed
    layers (issue #57), row formats other than the model dtype, synthetic prefill, data and
    expert parallelism, speculative decoding."""
    f = "LLM."
    if args["kv_placement"] != "gpu":
        why = "(HiSparse placement of its compressed layers is not built yet)"
        _fail(f + "kv_placement", args["kv_placement"], f"'gpu' for a DeepSeek-V4 checkpoint {why}",
              example="gpu")  # fmt: skip
    check_choice(f + "kv_format", args["kv_format"], V4_KV_FORMATS)
    hooks: StepHooks | None = args["step_hooks"]
    if hooks is not None and hooks.synthetic_prefill:
        _fail(f + "step_hooks", hooks, "no synthetic prefill for DeepSeek-V4 (DSA models only)")
    if args.get("data_parallel_size", 1) != 1 or args.get("enable_expert_parallel"):
        name = (
            "data_parallel_size"
            if args.get("data_parallel_size", 1) != 1
            else "enable_expert_parallel"
        )
        _fail(f + name, args[name], "unset for a DeepSeek-V4 checkpoint (data and expert "
              "parallelism of its layers are not built; tensor_parallel_size is)")  # fmt: skip
    if args.get("speculative_config") is not None:
        _fail(f + "speculative_config", args["speculative_config"], "None for a DeepSeek-V4 "
              "checkpoint (its multi-row decode step is not built)")  # fmt: skip
    return True
