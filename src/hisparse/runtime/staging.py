"""Prefill staging: bring a prefill's earlier tokens back to the GPU for dense attention.

A prefill chunk whose earlier tokens live only on the host needs them on the GPU. The plan
renumbers the host blocks the step's requests reference into a compact staging cache (a block
shared by two requests is staged once), built once per step; each layer then copies the rows
whose page is still resident device-to-device and gathers the rest from the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
