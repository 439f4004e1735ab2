"""The CPU backend (docs/design.md §12.9): one package for the numpy data-plane ops, the
numba-compiled kernels of the batch-1 decode fast paths, and the state those paths keep.

- `backend`: `CpuBackend`, the instance registered for ``cpu`` in `hisparse.runtime.ops`.
- `ops`: the data-plane ops on whole-batch numpy (the reference's results bit for bit).
- `compile`: numba compilation of the kernel modules (optional: numpy/torch without it).
- `residency_kernels`, `selection_kernels`, `layer_kernels`: the compiled kernels' bodies.
- `numpy_views`, `step_arrays`: numpy views of pools, rows and step metadata.
"""

from __future__ import annotations

from hisparse.runtime.ops.cpu.backend import CpuBackend
from hisparse.runtime.ops.cpu.numpy_views import F32, U8

__all__ = ["F32", "U8", "CpuBackend"]
