"""One dispatch point for the data-plane ops (docs/design.md §6).

Every op exists as a plain-PyTorch reference (`reference`) and may have a kernel backend
registered for a device type: the Triton kernels register for ``cuda``, the CPU backend
(`cpu.CpuBackend`: vectorised numpy ops and the compiled batch-1 fast paths) for ``cpu`` (the
reference's per-request loops of small torch ops dominated a CPU decode step). Callers ask
`ops_for(device)` once and call the returned namespace;
``HISPARSE_OPS=reference`` forces the reference everywhere (debugging, A/B checks).
``HISPARSE_OPS=cpu`` forces the CPU backend (which hands non-CPU tensors to the reference).
``HISPARSE_OPS=triton`` forces the Triton kernels on every device: on CPU tensors that needs
``TRITON_INTERPRET=1`` set before Triton is first imported (the CPU tests do this).

The Triton module is imported lazily, on the first ``ops_for("cuda")``, so importing this
package never imports Triton; where Triton is missing, CUDA falls back to the reference. The
Triton resolve's tuning tables live with it, in `triton_resolve`.

What the rest of the runtime may rely on beyond the ops' results is declared by each backend
as flags on its namespace (`CAPABILITIES`) and read with `has_capability`, never by asking which
backend it is.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from hisparse import envs
from hisparse.runtime.ops import reference
from hisparse.runtime.ops.cpu import CpuBackend


class DataPlaneOps(Protocol):
    resolve_residency: object
    gather_compact: object
    gather_compact_group: object
    gather_plan: object
    invalidate_written_slots: object
    resident_rows: object
    scatter_rows: object


#: The ops every backend must provide (the fields of `DataPlaneOps`).
OP_NAMES: tuple[str, ...] = (
    "resolve_residency",
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
    "resident_rows",
    "scatter_rows",
)

#: Flags a backend namespace may declare (``True``; missing or anything else: not declared):
#: ``CUDA_GRAPH_CAPTURABLE``: no host sync and no grid sized by data, so a decode step calling
#: the ops can be captured in a CUDA graph;
#: ``CPU_DECODE_FAST_PATH``: the runtime's compiled batch-1 decode path (`CpuBackend.jit`) may
#: run in place of the ops on CPU tensors, with their results bit for bit;
#: ``RESOLVE_ADDS_TOTALS``: ``resolve_residency`` takes ``totals=`` (int64 ``[3]``) and
#: ``n_layers=`` and adds the call's hits, misses and rows moved itself (no counting kernels);
#: ``INVALIDATE_MIRRORS``: ``invalidate_written_slots`` takes ``mirror=(src, dst, src_rows)``
#: and also runs ``gather_plan(src, dst, src_rows, written_rows, None)`` (one launch).
CAPABILITIES: tuple[str, ...] = (
    "CUDA_GRAPH_CAPTURABLE",
    "CPU_DECODE_FAST_PATH",
    "RESOLVE_ADDS_TOTALS",
    "INVALIDATE_MIRRORS",
)

_backends: dict[str, ModuleType | object] = {}


def has_capability(ops: ModuleType | object, name: str) -> bool:
    """Whether the namespace ``ops`` itself declares capability ``name`` (`CAPABILITIES`).

    Read from the namespace's own attributes, not through attribute forwarding: a wrapper that
    forwards every op (`bench.swap_timer`'s timed ops, a test's proxy) exists to see each op
    call, so it does not inherit a path that skips them.
    """
    if name not in CAPABILITIES:
        raise ValueError(f"unknown backend capability {name!r}: one of {CAPABILITIES}")
    try:
        own = vars(ops)
    except TypeError:  # no __dict__: declares nothing
        return False
    return own.get(name) is True


def register_backend(device_type: str, ops: ModuleType | object) -> None:
    """Make ``ops`` (a namespace with every op of `OP_NAMES`) the implementation for a device."""
    for name in OP_NAMES:
        if not callable(getattr(ops, name, None)):
            raise TypeError(f"ops backend for {device_type!r} lacks {name}()")
    _backends[device_type] = ops


def triton_ops() -> ModuleType:
    """The Triton backend (imports Triton). Raises ImportError where Triton is missing."""
    from hisparse.runtime.ops import triton_backend

    return triton_backend


def _load_cuda_backend() -> None:
    """Register the Triton kernels for ``cuda`` on first use, unless something else is."""
    if "cuda" in _backends:
        return
    try:
        register_backend("cuda", triton_ops())
    except ImportError:
        _backends["cuda"] = reference


def ops_for(device: torch.device | str) -> ModuleType | object:
    """The op namespace used for tensors on ``device``."""
    choice = envs.value("HISPARSE_OPS")
    if choice == "reference":
        return reference
    if choice == "cpu":
        return cpu_backend()
    if choice == "triton":
        return triton_ops()
    kind = torch.device(device).type
    if kind == "cuda":
        _load_cuda_backend()
    return _backends.get(kind, reference)


def cpu_backend() -> CpuBackend:
    """The CPU backend registered for ``cpu``: its ops, kernels and fast-path switches, used by
    the CPU fast paths whichever ops a caller was handed (``HISPARSE_OPS`` picks ops only)."""
    backend = _backends["cpu"]
    if not isinstance(backend, CpuBackend):
        raise TypeError(f"the backend registered for 'cpu' is {backend!r}, not a CpuBackend")
    return backend


register_backend("cpu", CpuBackend())

__all__ = [
    "CAPABILITIES",
    "OP_NAMES",
    "CpuBackend",
    "DataPlaneOps",
    "cpu_backend",
    "has_capability",
    "ops_for",
    "reference",
    "register_backend",
    "triton_ops",
]
