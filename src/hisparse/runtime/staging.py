"""Prefill staging: bring a prefill's earlier tokens back to the GPU for its attention.

A HiSparse prefill streams its pages to the host pool (docs/design.md §5.3): after each chunk
only the tail pages stay resident, so a later chunk's earlier tokens live on the host.
`PrefillStaging` is the engine's form (§6.6): one GPU buffer outside the block pool, reused by
every layer in turn, holding one row per context position of the step's requests; each layer
gathers its earlier rows from the host into it, writes the chunk's new rows there, mirrors
them to the host and copies the ones on resident (tail) pages into the pool, and attends
through it. `PrefillStagingPlan` is a stand-alone form: it renumbers the host blocks the
step's requests reference into a compact staged cache (a block shared by two requests is
staged once) in a fresh tensor, rows on resident pages copied device to device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hisparse.config import cdiv
from hisparse.runtime.ops import ops_for
from hisparse.runtime.sparse_layer import SparseLayerRuntime


@dataclass
class PrefillStagingPlan:
    """Host block -> staging block renumbering for one step.

    Attributes:
        block_table: ``[Q, NB]`` int32 staging block of each logical block (``-1``: none).
        host_rows: ``[U * bs]`` int32 host row staged into staging row ``i``.
        host_block_table: ``[Q, NB]`` the source block table the plan was built from.
        block_size: tokens per block.
    """

    block_table: torch.Tensor
    host_rows: torch.Tensor
    host_block_table: torch.Tensor
    block_size: int
    _resident_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.host_rows.numel() // self.block_size

    @classmethod
    def build(
        cls, source_block_table: torch.Tensor, num_context_blocks: torch.Tensor, block_size: int
    ) -> PrefillStagingPlan:
        """Plan for requests ``q`` reading their first ``num_context_blocks[q]`` blocks."""
        device = source_block_table.device
        nb = source_block_table.shape[1]
        cols = torch.arange(nb, device=device)[None, :]
        used = (cols < num_context_blocks.to(device).long()[:, None]) & (source_block_table > 0)
        unique_blocks, inverse = torch.unique(source_block_table[used], return_inverse=True)
        block_table = torch.full_like(source_block_table, -1)
        block_table[used] = inverse.to(block_table.dtype)
        offsets = torch.arange(block_size, device=device, dtype=torch.int64)
        host_rows = (unique_blocks.long()[:, None] * block_size + offsets).reshape(-1)
        return cls(
            block_table=block_table.to(torch.int32),
            host_rows=host_rows.to(torch.int32),
            host_block_table=source_block_table,
            block_size=block_size,
        )

    def resident_rows(self, resident_block_table: torch.Tensor) -> torch.Tensor:
        """``[U * bs]`` resident GPU row holding each staged row, ``-1`` where host-only.

        Computed once per resident group (its block table is shared by its layers).
        """
        key = id(resident_block_table)
        cached = self._resident_rows.get(key)
        if cached is not None:
            return cached
        bs = self.block_size
        device = self.block_table.device
        rows = torch.full((self.num_blocks,), -1, dtype=torch.int64, device=device)
        used = self.block_table >= 0
        res = resident_block_table.to(device).long()
        staged = self.block_table.long()
        # Any request referencing a host block holds an equivalent resident page.
        rows[staged[used]] = torch.where(res[used] > 0, res[used], -1)
        offsets = torch.arange(bs, device=device)
        per_row = torch.where(rows[:, None] > 0, rows[:, None] * bs + offsets, -1).reshape(-1)
        self._resident_rows[key] = per_row.to(torch.int32)
        return self._resident_rows[key]

    def stage(self, layer: SparseLayerRuntime, resident_block_table: torch.Tensor) -> torch.Tensor:
        """This layer's staged cache ``[U, bs, row_bytes]`` on the layer's device."""
        if layer.device_view is None or layer.host_view is None:
            raise ValueError(f"{layer.name}: staging needs bound host and device views")
        ops = ops_for(layer.device)
        staged = torch.empty(
            (self.num_blocks, self.block_size, layer.row_bytes),
            dtype=torch.uint8,
            device=layer.device,
        )
        dst = torch.arange(self.host_rows.numel(), dtype=torch.int32, device=layer.device)
        gpu_rows = self.resident_rows(resident_block_table)
        from_gpu = gpu_rows >= 0
        ops.gather_plan(layer.device_view, staged, gpu_rows, dst, from_gpu.to(torch.int32))
        ops.gather_plan(layer.host_view, staged, self.host_rows, dst, (~from_gpu).to(torch.int32))
        return staged


class PrefillStaging:
    """One prefill step's staging cache over a reused buffer (docs/design.md §6.6).

    Request ``q`` of the step gets the staging rows ``[base_q, base_q + starts[q] +
    counts[q])``, one per position of its context (requests one after another); a layer's
    staged cache is ``buffer`` viewed as ``[rows / bs, bs, row_bytes]``. Built once per
    step; per layer `stage` gathers the rows before ``starts[q]`` from the host (skipped with
    ``gather_earlier=False``: a step that writes rows and reads none, the synthetic
    prefill), the model writes the new rows at `write_rows`, `logical_rows` maps a top-k
    into the staged cache.

    Args:
        buffer: flat uint8 staging memory on the layers' device.
        source_block_table: ``[Q, NB]`` host blocks of the step's requests.
        starts, counts: per request, tokens already computed and tokens this step (lists).
        req_per_token, positions: ``[T]`` request row and position of each new token.
        block_size: tokens per page (of the host pool; the staged view's too).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        source_block_table: torch.Tensor,
        starts: list[int],
        counts: list[int],
        req_per_token: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        *,
        gather_earlier: bool = True,
    ) -> None:
        bs = block_size
        device = source_block_table.device
        self.buffer, self.block_size = buffer, bs
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        bases = [0]
        for e in ends[:-1]:
            bases.append(bases[-1] + e)
        self.rows = bases[-1] + ends[-1] if ends else 0
        self.base = torch.tensor(bases, dtype=torch.int64, device=device)
        self.write_rows = self._rows_of(req_per_token.long(), positions.long())
        self.src = self.dst = torch.zeros(0, dtype=torch.int32, device=device)
        earlier = sum(starts)
        if gather_earlier and earlier:
            # the rows before each request's start: host row -> staging row, position order
            counts_t = torch.tensor(starts, device=device)
            q = torch.repeat_interleave(torch.arange(len(starts), device=device), counts_t,
                                        output_size=earlier)  # fmt: skip
            first = torch.cumsum(counts_t, 0) - counts_t
            pos = torch.arange(earlier, device=device) - first[q]
            host = source_block_table[q, pos // bs].long() * bs + pos % bs
            self.src = host.to(torch.int32)
            self.dst = (self.base[q] + pos).to(torch.int32)
        self._views: dict[int, torch.Tensor] = {}

    def _rows_of(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        live = (pos >= 0) & (req >= 0)
        return torch.where(live, self.base[req.clamp_min(0)] + pos, -1).to(torch.int32)

    def view(self, row_bytes: int) -> torch.Tensor:
        """The staged cache of a layer with ``row_bytes`` rows: ``[pages, bs, row_bytes]``."""
        view = self._views.get(row_bytes)
        if view is None:
            pages = cdiv(self.rows, self.block_size)
            need = pages * self.block_size * row_bytes
            if need > self.buffer.numel():
                raise ValueError(
                    f"prefill staging needs {need:,} B for {self.rows} rows but the buffer has "
                    f"{self.buffer.numel():,}: the scheduler keeps a step's context rows within "
                    "the layout's staging area"
                )
            view = self.buffer[:need].view(pages, self.block_size, row_bytes)
            self._views[row_bytes] = view
        return view

    def stage(self, layer: SparseLayerRuntime) -> torch.Tensor:
        """``layer``'s staged cache, its rows before each request's start gathered from the
        host (complete: every prefill chunk mirrors its rows)."""
        if layer.host_view is None:
            raise ValueError(f"{layer.name}: staging needs a bound host view")
        view = self.view(layer.row_bytes)
        if self.src.numel():
            layer.group.ops.gather_plan(layer.host_view, view, self.src, self.dst, None)
        return view

    def logical_rows(self, topk: torch.Tensor, req_per_token: torch.Tensor) -> torch.Tensor:
        """Staged rows ``[N, K]`` of logical positions ``topk`` (``-1`` kept) of the rows'
        requests (a position is below its token's own, so inside the staged context)."""
        rows = topk.shape[0]
        req = req_per_token[:rows].long()[:, None].expand_as(topk)
        return self._rows_of(req, topk.long())
