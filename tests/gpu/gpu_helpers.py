"""What the GPU tests share: capturing a call in a CUDA graph (`hisparse.testing.cuda_graphs`),
and poisoned allocations."""

from __future__ import annotations

import pytest
import torch

from hisparse.testing.cuda_graphs import capture

__all__ = ["capture", "poison_empty"]


def poison_empty(monkeypatch: pytest.MonkeyPatch, ints: bool = False) -> None:
    """``torch.empty`` returns NaN-filled floats (and, with ``ints``, ``-7777``-filled int32 /
    int64): an element no kernel writes fails a check."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        if x.is_floating_point():
            return x.fill_(float("nan"))
        return x.fill_(-7777) if ints and x.dtype in (torch.int32, torch.int64) else x

    monkeypatch.setattr(torch, "empty", poisoned)
