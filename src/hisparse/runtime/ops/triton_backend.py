"""The Triton backend of the data-plane ops: the namespace `ops_for("cuda")` returns.

Collects the kernels' entry points (`triton_resolve`, `triton_gather`) under the names of
`OP_NAMES`.
"""

from __future__ import annotations

from hisparse.runtime.ops.triton_gather import (
    gather_compact,
    gather_compact_group,
    gather_plan,
    invalidate_written_slots,
)
from hisparse.runtime.ops.triton_resolve import resolve_residency

__all__ = [
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
    "resolve_residency",
]
