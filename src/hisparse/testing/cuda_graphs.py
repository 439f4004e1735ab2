"""Capturing a call in a CUDA graph, for the GPU tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def graph_call_us(fn: Callable[[], Any], calls: int = 10) -> float:
    """µs a call with ``calls`` calls of ``fn`` captured in one CUDA graph (replay median,
    ``triton.testing.do_bench``): the GPU's time, as a graph-captured decode step pays it,
    without a launch's host time per call."""
    import triton.testing

    def all_calls() -> None:
        for _ in range(calls):
            fn()

    graph, _ = capture(all_calls)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return 1e3 * ms / calls
