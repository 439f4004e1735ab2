"""Former home of the Triton data-plane kernels, kept as an import path (compat shim).

`hisparse.attention.sparse_mla_triton` imports it under the interpreter for the loop-bound fix
of `triton_common`; use `triton_backend` (the ops), `triton_resolve`, `triton_gather` or
`triton_common` instead.
"""

from __future__ import annotations

from hisparse.runtime.ops.triton_backend import (
    gather_compact,
    gather_compact_group,
    gather_plan,
    invalidate_written_slots,
    resolve_residency,
)
from hisparse.runtime.ops.triton_common import interpreting

__all__ = [
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "interpreting",
    "invalidate_written_slots",
    "resolve_residency",
]
