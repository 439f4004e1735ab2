"""Where a benchmark may change an engine step, without branches of its own in the runner.

`ModelRunner` calls a `StepHooks` object (if it has one) at these points only; every method
here is the no-op the plain engine runs. `hisparse.bench.hooks.BenchHooks` implements them:
top-k replay (decode selections and the prefill's warm-start selection replaced by
replayed ones), synthetic prefill (prompt rows written directly instead of the forward), and
swap-in timing (CUDA events around resolve and gathers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepRequests:
    """The requests of a step as device tensors (one entry per request row)."""

    #: hot-state slot of each request
    slots: torch.Tensor
    #: tokens each request holds after the step
    lens: torch.Tensor
    #: a stable per-request key (the same in both placements)
    keys: torch.Tensor
    #: keys a selection may reach (host-known bound of ``lens``)
    max_len: int

    def pick(self, rows: torch.Tensor) -> StepRequests:
        return StepRequests(self.slots[rows], self.lens[rows], self.keys[rows], self.max_len)


class StepHooks:
    """No-op hooks (subclass and override)."""

    #: False: the decode step cannot be captured in a CUDA graph (it runs the same fixed-
    #: shape step eagerly)
    capturable: bool = True
    #: True: `warm_topk` gives the warm-start selection of every prompt that finishes, in
    #: both placements (so the replayed decode starts from it)
    replaces_topk: bool = False
    #: True: `write_prefill` replaces the forward of prefill steps
    synthetic_prefill: bool = False

    def bind(self, runner: Any) -> None:
        """Called once by the runner after its layers exist."""

    def reset_slot(self, slot: int) -> None:
        """A new request took hot-state slot ``slot``."""

    def decode_topk(self, leader: int, topk: torch.Tensor, reqs: StepRequests) -> torch.Tensor:
        """The logical top-k ``[rows, K]`` index-group leader ``leader`` uses in a decode step."""
        return topk

    def warm_topk(self, leader: int, reqs: StepRequests) -> torch.Tensor | None:
        """The warm-start selection of the prompts finishing in this prefill step (``None``:
        the model's own last-token selection)."""
        return None

    def write_prefill(self, runner: Any, index_rows: torch.Tensor, keys: torch.Tensor,
                      positions: torch.Tensor) -> None:  # fmt: skip
        """Write a prefill step's KV rows and indexer keys (``synthetic_prefill`` only)."""
        raise NotImplementedError

    def first_tokens(self, keys: list[int], vocab_size: int) -> list[int]:
        """The first token of each prompt a synthetic prefill finishes."""
        raise NotImplementedError

    def keep_step_state(self) -> Callable[[], None]:
        """Copy what a decode step changes in the hooks' own state; the returned call puts it
        back. `DecodeGraphs.run` takes the copy before a step it will repeat (to compile the
        other kind of graph) and puts it back before the repeat, so the repeat makes the same
        choices (a replayed top-k: the same selection) and writes the same rows."""
        return lambda: None

    def begin_step(self, decode: bool) -> None:
        """Before a step's forward."""

    def end_step(self, decode: bool) -> None:
        """After a step's forward."""

    def before_padded_decode(self) -> None:
        """Before a fixed-shape (padded, CUDA-graph) decode step."""

    def after_padded_decode(self, runner: Any, slots: list[int], keys: list[int],
                            lens: list[int]) -> None:  # fmt: skip
        """After it: ``slots``, ``keys`` and ``lens`` of the real rows."""

    def step_timings(self) -> list[dict[str, float]]:
        """Per decode step measurements recorded since the last call (read once per run)."""
        return []
