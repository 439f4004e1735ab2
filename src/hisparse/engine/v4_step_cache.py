"""The `V4Cache` a DeepSeek-V4 model sees during one engine step (docs/design.md §20, §20.2).

All-GPU placement: each layer's rows live in its sparse cache's pool as `v4_cache.row_layout`
rows (window row, and the entries at the row of their window's last token), found through the
step's resident block tables like every other model's rows. HiSparse placement: a compressed
sparse layer's entries are a sparse cache of their own, driven through the runtime's per-layer
protocol (`write_target`, `finish_kv_update`, `swap_in`: host mirror, resolve against the hot
buffer, gathers, prefill staging, warm start); the HCA and indexer entries sit in GPU-resident
``indexer``-kind caches, each spread over its window's token rows
(`v4_cache.hisparse_row_layout`), and the window rows in a ring per request slot. The
compressors' carried state lives per request slot (`v4_cache.SlotState`) in both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hisparse.attention.dispatch import v4_attention
from hisparse.engine.hooks import StepHooks
from hisparse.models.deepseek_v4 import StepIndex
from hisparse.models.kv_access import ForwardStep
from hisparse.models.registry import V4_KV_FORMATS
from hisparse.models.v4_cache import (
    HOST_STORE,
    WINDOW_RING,
    SlotState,
    hisparse_row_layout,
    row_layout,
)
from hisparse.validation import _fail, check_choice

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner
    from hisparse.engine.step_cache import StepCache


class _EntryStep:
    """One compressed sparse layer's entry cache in this step (HiSparse): its step view (the
    runtime handle, or a prefill's staged view), where the step's rows go, whether mirrored."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.target, self.rows = view.write_target()
        self.finished = False

    def finish(self) -> None:
        """The host mirror and the hot slots' invalidation, once, before any swap-in."""
        if not self.finished:
            self.view.finish_kv_update()
            self.finished = True


class V4StepCache:
    """Row-addressed reads and writes of one step over the runner's pools (module docstring)."""

    def __init__(
        self, runner: ModelRunner, state: SlotState, step_cache: StepCache, step: ForwardStep
    ) -> None:
        self.runner, self.state, self.step_cache = runner, state, step_cache
        self.config = runner.model.config
        self.dtype = runner.model.head.weight.dtype
        self.block_size = runner.config.block_size
        self.slots = runner.step_requests().slots  # engine slot of each request row
        #: the all-GPU pool and the HiSparse resident cache alike: one table (design §4)
        self.table = step_cache.idx_table
        self.hisparse = runner.kv.hisparse
        self.step, self.where = step, StepIndex.of(step)
        #: HiSparse: each layer's window rows of this step (request rows, positions, values),
        #: read by its attention, then the newest kept in the ring (`_keep_window`)
        self._window: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        #: HiSparse: handle index of each compressed sparse layer's entry cache
        self._sparse = {int(h.runtime.name.split(".")[1]): k for k, h in enumerate(runner.handles)}
        self._entries: dict[int, _EntryStep] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def _layout(self, layer: int) -> dict[str, tuple[int, int]]:
        if self.hisparse:
            return hisparse_row_layout(self.config, layer)
        return row_layout(self.config, layer)

    def _pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s GPU-resident pages as ``[blocks, block_size, row values]`` of the
        model dtype (a view: the pool may interleave layers, so it is indexed, never
        reshaped)."""
        rows = self._rows.get(layer)
        if rows is None:
            if self.hisparse:
                view = self.runner.kv.gpu_view(f"layers.{layer}.indexer")
            else:
                view = self.runner.handles[layer].runtime.device_view
            assert view is not None, "device view not bound"
            rows = view.view(self.dtype)
            assert rows.shape[-1] == sum(w for _, w in self._layout(layer).values())
            self._rows[layer] = rows
        return rows

    def _physical(
        self, req_row: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in the block) of each request row's position ``pos``; padding rows
        (``req_row < 0``) and ``pos < 0`` (a write to skip) land in the null block 0, which
        no valid read names."""
        bs = self.block_size
        p = pos.clamp(min=0).long()
        r = req_row.long().expand(p.shape)
        blk = self.table[r.clamp(min=0), p // bs].long()
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

    def _spread(self, layer: int, store: str) -> tuple[int, int] | None:
        """HiSparse: (rate, full width) of a GPU-resident entry store, whose entries are
        spread over their window's token rows (`v4_cache.hisparse_row_layout`); else None."""
        if not self.hisparse or not store.startswith("entries.") or self._on_host(layer, store):
            return None
        width = self.config.index_head_dim if store == "entries.indexer" else self.config.head_dim
        return self.config.compress_rate(layer), width

    def _spread_rows(
        self, req_row: torch.Tensor, w: torch.Tensor, rate: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) ``[*w.shape, rate]`` of entry ``w``'s token rows (``w < 0``: the
        null block)."""
        j = torch.arange(rate, device=w.device)
        rows = torch.where(w.unsqueeze(-1) >= 0, w.unsqueeze(-1) * rate + j, -1)
        return self._physical(req_row.unsqueeze(-1), rows)

    def _on_host(self, layer: int, store: str) -> bool:
        return self.hisparse and store == HOST_STORE and layer in self._sparse

    def _entry_step(self, layer: int) -> _EntryStep:
        step = self._entries.get(layer)
        if step is None:
            step = _EntryStep(self.step_cache.attention(self._sparse[layer]))
            self._entries[layer] = step
        return step

    def _write_entries(
        self, layer: int, req_row: torch.Tensor, w: torch.Tensor, values: torch.Tensor
    ) -> None:
        """HiSparse: the entries of the windows this step closes into their sparse cache, at
        the row of the closing token (a token of this step, so on a resident tail page or in
        the prefill's staged rows); mirrored to the host by `_EntryStep.finish`."""
        es = self._entry_step(layer)
        r = req_row.long().clamp(min=0)
        p = self._logical(layer, HOST_STORE, w)
        token = (self.where.first_token[r] + p - self.where.start_pos[r]).clamp(min=0)
        keep = (w >= 0) & (req_row >= 0)
        rows = torch.where(keep, es.rows[token].long(), -1)
        target = es.target.view(self.dtype)
        bs = target.shape[1]
        if getattr(es.view, "staging", None) is not None:  # a prefill: never the null block
            pick = rows >= 0
            rows, values = rows[pick], values[pick]
        # a skipped row (w < 0: a fixed-shape step's window that does not close) writes the
        # null block, which no valid read names
        safe = rows.clamp(min=0)
        target[safe // bs, safe % bs] = values.to(target.dtype)

    def write(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor, values: torch.Tensor
    ) -> None:
        if store.startswith("state."):
            t = self.state.stores[(layer, store)]
            t[self._slot(req_row), pos.long()] = values.to(t.dtype)
            return
        if self._on_host(layer, store):
            self._write_entries(layer, req_row, pos, values)
            return
        if self.hisparse and store == "window":  # to the ring after the layer's attention
            self._window[layer] = (req_row, pos, values)
            return
        first, width = self._layout(layer)[store]
        spread = self._spread(layer, store)
        if spread is not None:  # a slice of the entry into each of its window's rows
            rate, full = spread
            blk, off = self._spread_rows(req_row, pos, rate)
            pool = self._pool(layer)
            flat = torch.nn.functional.pad(values.to(pool.dtype), (0, rate * width - full))
            pool[blk, off, first : first + width] = flat.view(-1, rate, width)
            return
        blk, off = self._physical(req_row, self._logical(layer, store, pos))
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
        (`attention.dispatch.v4_attention`: the Triton kernel on CUDA). Under HiSparse a
        compressed sparse layer's entries are resolved against the hot buffer first."""
        bs = self.block_size

        def rows(store: str, pos: torch.Tensor) -> torch.Tensor:
            blk, off = self._physical(req[:, None], self._logical(layer, store, pos))
            return torch.where(pos >= 0, blk * bs + off, -1)

        if self.hisparse:
            out = self._attend_hisparse(layer, q, req, window, entries, sinks, scale)
            self._keep_window(layer)
            return out
        pool = self._pool(layer)
        idx = rows("window", window)
        if entries is not None:
            idx = torch.cat((idx, rows("entries.compressor", entries)), dim=1)
        entry_col, _ = self._layout(layer).get("entries.compressor", (0, 0))
        return v4_attention(q, pool, idx, window.shape[1], entry_col, sinks, scale)

    def _window_rows(self, layer: int, req: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """HiSparse: the rows ``[N, W, D]`` of window positions ``window [N, W]`` (``-1``:
        none, zeros): this step's own rows where the position is in the step, the request
        slot's ring otherwise (it holds the newest ``W`` positions of the steps before)."""
        _, _, kv = self._window[layer]
        ring = self.state.stores[(layer, WINDOW_RING)]
        r = req.long().clamp(min=0)[:, None]
        start = self.where.start_pos[r]
        tok = (self.where.first_token[r] + window - start).clamp(0, kv.shape[0] - 1)
        slot = self._slot(req)[:, None].expand(window.shape)
        old = ring[slot, window.clamp(min=0) % ring.shape[1]]
        rows = torch.where((window >= start).unsqueeze(-1), kv[tok].to(ring.dtype), old)
        return rows.masked_fill((window < 0).unsqueeze(-1), 0)

    def _keep_window(self, layer: int) -> None:
        """After the layer's attention: each request's newest ``W`` window rows of the step
        into its slot's ring (a fixed-shape step: every row, each its request's newest;
        padding rows to the spare slot)."""
        req, pos, kv = self._window.pop(layer)
        ring = self.state.stores[(layer, WINDOW_RING)]
        w = ring.shape[1]
        newest = (pos >= self.step.seq_lens[req.clamp(min=0)] - w) & (req >= 0)
        keep = torch.arange(pos.shape[0], device=pos.device)
        if not self.step.static:
            keep = newest.nonzero().squeeze(1)
        ring[self._slot(req[keep]), pos[keep] % w] = kv[keep].to(ring.dtype)

    def _attend_hisparse(
        self,
        layer: int,
        q: torch.Tensor,
        req: torch.Tensor,
        window: torch.Tensor,
        entries: torch.Tensor | None,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention under HiSparse: the window rows (`_window_rows`) and the entries
        gathered side by side into one step buffer, attended with the kernel of the all-GPU
        placement. A compressed sparse layer first mirrors the step's entries and resolves
        the indexer's choice (as token rows) to physical rows of its entry cache (resident
        tail, hot buffer, or a prefill's staged rows); a heavily compressed layer reads its
        entries in its resident cache."""
        d, w = q.shape[-1], window.shape[1]

        def take(view: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
            safe = phys.clamp(min=0).long()
            return view[safe // view.shape[1], safe % view.shape[1], :d]

        parts, valid = [self._window_rows(layer, req, window)], [window >= 0]
        if layer not in self._sparse:
            if entries is not None:  # HCA: every readable entry, from its window's rows
                parts.append(self.read(layer, HOST_STORE, req[:, None], entries))
                valid.append(entries >= 0)
            return self._attend_rows(q, parts, valid, w, sinks, scale)
        es = self._entry_step(layer)
        es.finish()
        if entries is not None:
            logical = self._logical(layer, HOST_STORE, entries).to(torch.int32)
            phys = es.view.swap_in(logical)
            staged = getattr(es.view, "staged", None)
            if staged is None:  # decode: resident and hot rows share the pool's address space
                staged = self.runner.handles[self._sparse[layer]].runtime.device_view
            source = staged
            if q.device.type == "cpu" and bool(((entries >= 0) & (phys < 0)).any()):
                raise RuntimeError(f"layer {layer}: a selected entry has no physical row")
            parts.append(take(source.view(self.dtype), phys))
            valid.append(entries >= 0)
        return self._attend_rows(q, parts, valid, w, sinks, scale)

    @staticmethod
    def _attend_rows(
        q: torch.Tensor,
        parts: list[torch.Tensor],
        valid: list[torch.Tensor],
        n_window: int,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`v4_attention` over rows gathered into one step buffer (window rows first)."""
        n, d = q.shape[0], q.shape[-1]
        rows = torch.cat(parts, dim=1).contiguous()  # [N, W + E, D]
        k = rows.shape[1]
        idx = torch.arange(n * k, device=q.device, dtype=torch.int64).view(n, k)
        idx = torch.where(torch.cat(valid, dim=1), idx, -1)
        return v4_attention(q, rows.view(n * k, 1, d), idx, n_window, 0, sinks, scale)

    def read(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        if store.startswith("state."):
            t = self.state.stores[(layer, store)]
            slot = self._slot(req_row).expand(pos.shape)
            out = t[slot, pos.clamp(min=0).long()]
        elif self._on_host(layer, store) or (self.hisparse and store == "window"):
            raise RuntimeError(f"layer {layer}: {store} is read through attend (HiSparse)")
        elif (spread := self._spread(layer, store)) is not None:
            rate, full = spread
            first, width = self._layout(layer)[store]
            blk, off = self._spread_rows(req_row.expand(pos.shape), pos, rate)
            out = self._pool(layer)[blk, off, first : first + width]  # [..., rate, width]
            out = out.reshape(*pos.shape, rate * width)[..., :full]
        else:
            first, width = self._layout(layer)[store]
            blk, off = self._physical(req_row, self._logical(layer, store, pos))
            out = self._pool(layer)[blk, off, first : first + width]
        return out.masked_fill((pos < 0).unsqueeze(-1), 0)


def check_v4_arguments(args: dict[str, Any]) -> bool:
    """True, or a `HiSparseConfigError` for an `LLM` argument (``args``: all of them by name)
    that a DeepSeek-V4 checkpoint does not run with yet: HiSparse placement under tensor
    parallelism, row formats other than the model dtype, synthetic prefill, data and expert
    parallelism, speculative decoding."""
    f = "LLM."
    if args["kv_placement"] == "hisparse" and args.get("tensor_parallel_size", 1) != 1:
        _fail(f + "kv_placement", args["kv_placement"], "'gpu' for a DeepSeek-V4 checkpoint "
              "under tensor parallelism (its HiSparse placement runs on one GPU)",
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
