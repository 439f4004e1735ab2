"""The benchmark-only modes as `StepHooks` of the engine, applied to both placements alike.

* ``topk_overlap``: every decode top-k is replaced by a replayed selection with that
  step-to-step overlap (`hisparse.bench.replay`); the indexer still runs. A finishing prompt's
  warm start takes the replay's first selection.
* ``synthetic_prefill``: prompts' KV rows and indexer keys are written directly
  (`hisparse.bench.synthetic`) instead of running the prefill; the first token is a hash.
* ``timing``: resolve and gather of every decode step are timed with CUDA events
  (`hisparse.bench.swap_timer`); events cannot live in a CUDA graph, so the decode step then
  runs its fixed-shape form eagerly.

    LLM(path, step_hooks=BenchHooks(topk_overlap=0.8, synthetic_prefill=True))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hisparse.bench.replay import TopKReplay
from hisparse.bench.swap_timer import SwapTimer
from hisparse.bench.synthetic import SyntheticPrefill, first_token
from hisparse.engine.hooks import StepHooks, StepRequests
from hisparse.validation import check_bool, check_float, check_int


class BenchHooks(StepHooks):
    def __init__(
        self,
        *,
        topk_overlap: float | None = None,
        synthetic_prefill: bool = False,
        timing: bool = False,
        seed: int = 0,
    ) -> None:
        f = "BenchHooks."
        self.overlap = check_float(
            f + "topk_overlap", topk_overlap, minimum=0, maximum=1, optional=True
        )
        self.synthetic_prefill = bool(check_bool(f + "synthetic_prefill", synthetic_prefill))
        self.timing = bool(check_bool(f + "timing", timing))
        self.seed = check_int(f + "seed", seed, minimum=0, maximum=2**63 - 1)
        self.replaces_topk = self.overlap is not None
        self.capturable = not timing
        self.replay: TopKReplay | None = None
        self.synthetic: SyntheticPrefill | None = None
        self.timer: SwapTimer | None = None
        self._log: Any = None

    def bind(self, runner: Any) -> None:
        if self.overlap is not None:
            self.replay = TopKReplay(
                top_k=runner.config.top_k,
                overlap=self.overlap,
                seed=self.seed,
                num_leaders=len(runner.leaders),
                max_slots=runner.max_num_seqs + 1,  # + the slot padded decode rows write to
                device=runner.device,
            )
        if self.synthetic_prefill:
            self.synthetic = SyntheticPrefill(runner.model, runner.row_format, self.seed)
        if self.timing and runner.kv.hisparse:
            self.timer = SwapTimer(runner.device)
            for h in runner.leaders:
                self.timer.wrap(h.runtime.group)

    def reset_slot(self, slot: int) -> None:
        if self.replay is not None:
            self.replay.reset_slot(slot)

    def keep_step_state(self) -> Callable[[], None]:
        """The replay's previous selections (and its log's length): a step advances them."""
        replay = self.replay
        if replay is None:
            return lambda: None
        prev = replay.prev.clone()
        logged = None if replay.log is None else len(replay.log)

        def restore() -> None:
            replay.prev.copy_(prev)
            if replay.log is not None and logged is not None:
                del replay.log[logged:]

        return restore

    def decode_topk(self, leader: int, topk: torch.Tensor, reqs: StepRequests) -> torch.Tensor:
        if self.replay is None:
            return topk
        sel = self.replay.select(leader, reqs.slots, reqs.lens, reqs.keys, reqs.max_len)
        return sel[:, : topk.shape[1]] if sel.shape[1] != topk.shape[1] else sel

    def warm_topk(self, leader: int, reqs: StepRequests) -> torch.Tensor | None:
        if self.replay is None:
            return None
        return self.replay.select(leader, reqs.slots, reqs.lens, reqs.keys, reqs.max_len)

    def write_prefill(self, runner: Any, index_rows: torch.Tensor, keys: torch.Tensor,
                      positions: torch.Tensor) -> None:  # fmt: skip
        assert self.synthetic is not None
        caches = runner.prefill_layer_caches()
        self.synthetic.write(caches, runner.indexer_pages, index_rows, keys, positions)

    def first_tokens(self, keys: list[int], vocab_size: int) -> list[int]:
        return [first_token(self.seed, k, vocab_size) for k in keys]

    def begin_step(self, decode: bool) -> None:
        if self.timer is not None:
            self.timer.active = decode

    def end_step(self, decode: bool) -> None:
        if self.timer is not None:
            self.timer.end_step(decode)

    def before_padded_decode(self) -> None:
        if self.replay is not None:
            # padded rows are not selections: the real rows are logged afterwards
            self._log, self.replay.log = self.replay.log, None

    def after_padded_decode(self, runner: Any, slots: list[int], keys: list[int],
                            lens: list[int]) -> None:  # fmt: skip
        if self.replay is None:
            return
        self.replay.log, log = self._log, self._log
        if log is None:
            return
        for leader in range(len(runner.leaders)):
            sel = self.replay.prev[leader, slots].cpu()
            for r, (key, n) in enumerate(zip(keys, lens, strict=True)):
                log.append((leader, key, n, sel[r]))

    def step_timings(self) -> list[dict[str, float]]:
        return self.timer.collect() if self.timer is not None else []
