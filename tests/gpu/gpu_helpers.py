"""What the GPU tests share: capturing a call in a CUDA graph, and poisoned allocations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` run once on a side stream (compiles, allocates, as capture needs), then captured:
    the graph and the call's static output, which each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


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
