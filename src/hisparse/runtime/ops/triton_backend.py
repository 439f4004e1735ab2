"""The Triton backend of the data-plane ops: the namespace `ops_for("cuda")` returns.

Collects the kernels' entry points (`triton_resolve`, `triton_gather`) under the names of
`OP_NAMES` and declares the capability flags `has_capability` reads.
"""

from __future__ import annotations

from hisparse.runtime.ops.triton_gather import (
    gather_compact,
    gather_compact_group,
    gather_plan,
    invalidate_written_slots,
    scatter_rows,
)
from hisparse.runtime.ops.triton_resolve import resident_rows, resolve_residency

#: No host sync and no grid sized by data: a decode step of these ops can be captured.
CUDA_GRAPH_CAPTURABLE = True
#: The runtime's compiled CPU batch-1 decode path does not stand in for these ops.
CPU_DECODE_FAST_PATH = False
#: `resolve_residency` takes ``totals=`` and adds each step's hits, misses and rows moved.
RESOLVE_ADDS_TOTALS = True
#: `invalidate_written_slots` takes ``mirror=`` and copies the written rows to the host too.
INVALIDATE_MIRRORS = True

__all__ = [
    "CPU_DECODE_FAST_PATH",
    "CUDA_GRAPH_CAPTURABLE",
    "INVALIDATE_MIRRORS",
    "RESOLVE_ADDS_TOTALS",
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
    "resident_rows",
    "resolve_residency",
    "scatter_rows",
]
