"""Prefill staging: bring a prefill's earlier tokens back to the GPU for its attention.

A HiSparse prefill streams its pages to the host pool (docs/design.md §5.3): after each chunk
only the tail pages stay resident, so a later chunk's earlier tokens live on the host.
`PrefillStaging` is the engine's form (§6.6): one GPU buffer outside the block pool, reused by
every layer in turn, holding one row per context position of the step's requests; each layer
gathers its earlier rows from the host into it, writes the chunk's new rows there, mirrors
them to the host and copies the ones on resident (tail) pages into the pool, and attends
through it.
"""

from __future__ import annotations

import torch

from hisparse.config import cdiv
from hisparse.runtime.sparse_layer import SparseLayerRuntime


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
