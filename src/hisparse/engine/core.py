"""The engine core: the loop that turns requests into tokens, below the public `LLM` API.

One step reads top to bottom: the scheduler returns a `SchedulerOutput` (plain data), the
runner executes it and returns a `ModelOutput` per forward, and `Scheduler.update_from_output`
consumes each (nano-vllm's step over vLLM v1's seams). `AsyncEngineCore`
(`hisparse.engine.async_core`) overlaps the host's part of a decode step with the GPU's.

Under tensor parallelism (docs/design.md §18) the core of rank 0 drives: it tells the other
ranks to add, abort and step, and each of them runs the same core on its shard
(`hisparse.engine.tp_follower`). A failure inside a driver's step is fatal to the engine.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from typing import Any

from hisparse.engine.model_runner import ModelRunner
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.step_data import ScheduledStep

#: Engine steps kept in `EngineCore.step_stats` (older ones are dropped; `last_run_stats`
#: keeps every step of the latest `run`).
STEP_STATS_KEPT = 10_000

#: per forward whose tokens a step read: the requests it changed and its statistics row
StepReport = tuple[list[Request], dict[str, float]]


@dataclass(frozen=True)
class EngineGauges:
    """What the server's gauges and counters read from the engine: requests running and
    waiting, pool blocks, demotions and prefix-cache lookups (counters since start). Under
    data parallelism the node's: every rank's summed (`DataParallelCore.gauges`)."""

    running: int = 0
    waiting: int = 0
    gpu_total: int = 0
    gpu_used: int = 0
    host_total: int = 0
    host_used: int = 0
    demotions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @classmethod
    def of(cls, sched: Scheduler) -> EngineGauges:
        kv, cache = sched.kv, sched.kv.prefix_cache
        host = kv.host_blocks
        return cls(
            len(sched.running), len(sched.waiting), kv.gpu_blocks.num_usable,
            kv.gpu_blocks.num_usable - kv.gpu_blocks.num_free,
            host.num_usable if host is not None else 0,
            host.num_usable - host.num_free if host is not None else 0, sched.demotions,
            cache.queries if cache is not None else 0, cache.hits if cache is not None else 0,
        )  # fmt: skip

    def __add__(self, other: EngineGauges) -> EngineGauges:
        return EngineGauges(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class EngineCore:
    """Owns the scheduler and the runner and runs engine steps (synchronously: each step's
    tokens are read before the next is scheduled).

    ``tp``: the tensor-parallel group (`hisparse.parallel.TPGroup`) or ``None``;
    ``on_fatal()``: what a failure inside a tensor-parallel step does first (the `LLM`
    closes itself)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        tp: Any = None,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.tp, self.on_fatal = tp, on_fatal
        self._last_end = 0.0
        #: the last `STEP_STATS_KEPT` engine steps (all runs)
        self.step_stats: deque[dict[str, float]] = deque(maxlen=STEP_STATS_KEPT)
        #: every engine step of the latest `run`
        self.last_run_stats: list[dict[str, float]] = []

    # --- requests ------------------------------------------------------------------------
    def add(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.scheduler.add(req)
        if self.tp is not None and reqs:
            with self.tp_section():
                specs = [(r.req_id, r.prompt_token_ids, r.params, r.index) for r in reqs]
                self.tp.send(("add", specs))

    def abort(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.scheduler.abort(req)
        if self.tp is not None and reqs:
            with self.tp_section():
                self.tp.send(("abort", [r.req_id for r in reqs]))

    def add_from_driver(self, specs: list[Any]) -> None:
        """A worker: the requests the driver's `add` sent."""
        for rid, ids, params, index in specs:
            self.scheduler.add(Request(req_id=rid, prompt_token_ids=ids, params=params,
                                       index=index))  # fmt: skip

    def abort_from_driver(self, ids: list[str]) -> None:
        """A worker: the requests the driver's `abort` named (those this rank holds)."""
        wanted = set(ids)
        for req in [r for r in self.unfinished() if r.req_id in wanted]:
            self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def unfinished(self) -> list[Request]:
        """Every queued or running request (under data parallelism, every rank's)."""
        return [*self.scheduler.running, *self.scheduler.waiting]

    def gauges(self) -> EngineGauges:
        """The engine's gauges for the server's ``/metrics``."""
        return EngineGauges.of(self.scheduler)

    # --- steps ---------------------------------------------------------------------------
    def step(self) -> list[StepReport]:
        """One engine step: schedule, execute, update; per forward, the requests it changed
        and its statistics row. Every rank schedules the same (a driver tells the others to
        step first; they hold the same requests)."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(("step",))
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        reports = []
        for part, result in zip(out.parts, self.runner.execute(out), strict=True):
            self.scheduler.update_from_output(part, result)
            reports.append((part.requests, self.stats_row(part, t0, result.now)))
            t0 = result.now
        return reports

    def stats_row(self, step: ScheduledStep, t0: float, now: float) -> dict[str, float]:
        """``seconds``: from the forward's start, or from the previous step's end where it
        was launched before that (async scheduling), to its tokens."""
        start, self._last_end = max(t0, self._last_end), now
        return dict(
            decode=float(step.decode),
            tokens=sum(n for _, n in step.batch),
            running=len(step.batch) if step.decode else len(self.scheduler.running),
            seconds=now - start,
            end=now,
        )

    def run(
        self,
        requests: list[Request],
        on_progress: Callable[[int], None] | None = None,
        on_step: Callable[[list[Request]], None] | None = None,
    ) -> None:
        """Step until no request is left (those of ``requests`` and any others queued);
        ``on_progress(done)`` whenever more of ``requests`` have finished, ``on_step(requests)``
        after every step that ran (progress of long prompts). The per-request
        and per-step swap counters are read from the device once, at the end."""
        sched = self.scheduler
        done = sum(r.finished for r in requests)
        stalls = 0
        self.last_run_stats = run_stats = []
        try:
            while self.has_unfinished():
                with self.tp_section():
                    reports = self.step()
                    for _, row in reports:
                        run_stats.append(row)
                        self.step_stats.append(row)
                if not reports and not self.in_flight:
                    stalls += 1
                    if stalls > len(requests) + 2:
                        raise RuntimeError("scheduler stalled: nothing fits and nothing runs")
                    continue
                stalls = 0
                if on_step is not None:
                    on_step(requests)
                new_done = sum(r.finished for r in requests)
                if on_progress is not None and new_done > done:
                    on_progress(new_done)
                done = new_done
        finally:
            sched.failed.clear()
            # (none left when a tensor-parallel engine failed mid-run: it is closed)
            counters = self.runner.flush_metrics() if self.runner is not None else []
            decode_stats = iter(counters)
            for row in run_stats:
                if row["decode"]:
                    row.update(next(decode_stats, {}))

    @property
    def in_flight(self) -> bool:
        """A step whose tokens are still to be read (async scheduling only)."""
        return False

    def settle(self) -> None:
        """Drop work in flight that no request waits for (async scheduling only)."""

    def drain(self) -> None:
        """Wait for the device work in flight (before the pools are released)."""

    @contextlib.contextmanager
    def tp_section(self) -> Iterator[None]:
        """Tensor parallelism: the ranks finish this block together (Ctrl-C waits for its
        end), and any failure inside it is fatal: the engine closes and
        `TensorParallelError` names the rank that failed. Nothing without it."""
        tp = self.tp
        if tp is None:
            yield
            return
        from hisparse.parallel.group import deferred_sigint

        with deferred_sigint():  # a Ctrl-C it holds back is raised after the block, harmless
            try:
                yield
            except BaseException as err:
                self.on_fatal()
                raise tp.fail(err) from err


def run_with_progress(
    core: EngineCore,
    requests: list[Request],
    progress: bool,
    on_finish: Any = None,
    on_step: Any = None,
) -> None:
    """`EngineCore.run` with a progress bar (``progress``), ``on_finish(done, total)`` and
    ``on_step(requests)`` after every step."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    done = [sum(r.finished for r in requests)]

    def on_progress(new_done: int) -> None:
        bar.update(new_done - done[0])
        if on_finish is not None:
            on_finish(new_done, len(requests))
        done[0] = new_done

    try:
        core.run(requests, on_progress, on_step)
    finally:
        bar.close()


@contextlib.contextmanager
def young_objects_only(device: Any) -> Iterator[None]:
    """On the CPU: the objects that exist when a call starts (model, caches, everything
    loaded) are frozen (`gc.freeze`) for the call, so the cyclic collector's full passes
    during it walk only the call's own objects. Measured on SmolLM2 (batch 1): a full pass
    over the loaded process took a sizeable share of a decode step's time, every few dozen
    tokens. Unfrozen after the call (nothing is kept from the collector for longer); left
    alone where something else froze objects, and on CUDA."""
    if device.type != "cpu" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
