"""Optional timing of the swap-in ops (resolve, gather) without host syncs in the hot path.

The timer wraps an index group's ops object: calls of ``resolve_residency`` and the gathers
(``gather_compact``, ``gather_compact_group``) are bracketed by CUDA events recorded on the
stream they run on (the copy stream), and the events are read only by `collect`, after the
run. On the CPU the ops run synchronously, so wall-clock time is exact there. Other ops
(host mirror, invalidation, warm-start copies) pass through untimed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

_TIMED = {
    "resolve_residency": "resolve",
    "gather_compact": "gather",
    "gather_compact_group": "gather",
}


class _TimedOps:
    """Delegates to ``ops``; times the calls named in `_TIMED` while the timer is active."""

    def __init__(self, ops: Any, timer: SwapTimer) -> None:
        self._ops, self._timer = ops, timer

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        kind = _TIMED.get(name)
        if kind is None or not callable(fn):
            return fn
        return lambda *a, **k: self._timer.timed(kind, fn, a, k)


class SwapTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = False
        self._step: list[tuple[str, Any, Any]] = []
        self._steps: list[list[tuple[str, Any, Any]]] = []

    def wrap(self, group: Any) -> None:
        """Time ``group``'s ops from now on (an `IndexGroupRuntime`)."""
        if not isinstance(group.ops, _TimedOps):
            group.ops = _TimedOps(group.ops, self)

    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()  # on the current stream: the leader's resolve runs on it (copy or compute)
            return ev
        return time.perf_counter()

    def timed(self, kind: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.active:
            return fn(*args, **kwargs)
        start = self._mark()
        out = fn(*args, **kwargs)
        self._step.append((kind, start, self._mark()))
        return out

    def end_step(self, record: bool) -> None:
        """Close the step: keep its marks if ``record`` (decode steps), else drop them."""
        if record:
            self._steps.append(self._step)
        self._step = []
        self.active = False

    def collect(self) -> list[dict[str, float]]:
        """Milliseconds in resolve and gather per recorded step (syncs once), then reset."""
        if self.cuda and self._steps:
            torch.cuda.synchronize()
        out = []
        for marks in self._steps:
            row = {"resolve_ms": 0.0, "gather_ms": 0.0}
            for kind, a, b in marks:
                ms = a.elapsed_time(b) if self.cuda else 1e3 * (b - a)
                row[f"{kind}_ms"] += ms
            out.append(row)
        self._steps = []
        return out
