"""One dispatch point for the data-plane ops (DESIGN.md §4).

Every op exists as a plain-PyTorch reference (`reference`) and may have a kernel backend
registered for a device type (the Triton kernels register for ``cuda``). Callers ask
`ops_for(device)` once and call the returned namespace; ``HISPARSE_OPS=reference`` forces the
reference everywhere (debugging, A/B checks).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Protocol

import torch

from hisparse.runtime.ops import reference


class DataPlaneOps(Protocol):
    resolve_residency: object
    gather_compact: object
    gather_plan: object
    invalidate_written_slots: object


_backends: dict[str, ModuleType | object] = {}


def register_backend(device_type: str, ops: ModuleType | object) -> None:
    """Make ``ops`` (a namespace with the four ops) the implementation for ``device_type``."""
    for name in ("resolve_residency", "gather_compact", "gather_plan", "invalidate_written_slots"):
        if not callable(getattr(ops, name, None)):
            raise TypeError(f"ops backend for {device_type!r} lacks {name}()")
    _backends[device_type] = ops


def ops_for(device: torch.device | str) -> ModuleType | object:
    """The op namespace used for tensors on ``device``."""
    choice = os.environ.get("HISPARSE_OPS", "auto")
    if choice not in ("auto", "reference"):
        raise ValueError(f"HISPARSE_OPS={choice!r}: use 'auto' or 'reference'.")
    if choice == "reference":
        return reference
    return _backends.get(torch.device(device).type, reference)


__all__ = ["DataPlaneOps", "ops_for", "reference", "register_backend"]
