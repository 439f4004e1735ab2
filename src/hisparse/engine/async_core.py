"""Async scheduling (docs/design.md §12.5.1): a decode step on the fixed-shape path leaves its
sampled tokens on the device, and the next decode of the same requests is launched reading
them there before the host reads and records them, so the host's part of a step (reading
tokens, stops, scheduling, loading inputs) runs while the GPU computes.

It is one subclass of the engine core (vLLM makes it one too): the synchronous step is
`EngineCore.step`; this one adds the step in flight.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from hisparse.engine.core import EngineCore, StepReport
from hisparse.engine.request import Request
from hisparse.engine.sampling import LogprobRows, logprob_rows, sample_on_device
from hisparse.engine.step_data import ModelOutput, SchedulerOutput


@dataclasses.dataclass
class InFlight:
    """A decode step launched with its sampled tokens left on the device: ``tokens`` feed
    the next decode's input ids on the device; ``host`` holds them, and ``logprobs`` the
    rows' logprobs where asked, once ``ready`` (``None`` on the CPU) has completed."""

    out: SchedulerOutput
    sample_reqs: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    logprobs: LogprobRows | None
    ready: torch.cuda.Event | None
    t0: float


class AsyncEngineCore(EngineCore):
    """`EngineCore` with a decode in flight: used on one rank with the fixed-shape decode
    path (`LLM(async_scheduling=True)`, the default, on CUDA graphs)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inflight: InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self.inflight is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None

    def step(self) -> list[StepReport]:
        """With a decode in flight, the next decode of the same requests is launched first
        where `Scheduler.continue_decode` gives one, and the host reads and records the
        pending tokens while the GPU runs it; otherwise the pending tokens are read first
        and the step is scheduled as usual. A lone decode part stays in flight."""
        prev, self.inflight = self.inflight, None
        reports = []
        if prev is not None:
            nxt = self.scheduler.continue_decode(prev.out.parts[0].batch)
            if nxt is not None:
                try:
                    self._launch(nxt, prev.tokens)
                except BaseException:
                    self._collect(prev)  # its requests stay whole for whoever goes on
                    raise
                return [self._collect(prev)]
            reports.append(self._collect(prev))
        out = self.scheduler.schedule()
        if len(out.parts) == 1 and self._deferrable(out):
            self._launch(out, None)
            return reports
        t0 = time.perf_counter()
        for part, result in zip(out.parts, self.runner.execute(out), strict=True):
            # a decode with a prefill part after it reads its tokens first: rows stay in the
            # order the parts ran
            self.scheduler.update_from_output(part, result)
            reports.append((part.requests, self.stats_row(part, t0, result.now)))
            t0 = result.now
        return reports

    def _deferrable(self, out: SchedulerOutput) -> bool:
        """A decode of one row per request may leave its tokens on the device. Logprobs go
        to the host with the tokens; the next step's penalties and ``min_tokens`` count the
        token still on the device (`sampling.sample_on_device`'s ``pending``). A row with a
        grammar (structured outputs) is not deferred: its next mask is computed on the host
        from its matcher, which must have accepted this token first."""
        step = out.parts[0]
        # the fixed-shape path takes the device tokens (a benchmark may switch it off)
        fixed_shape = self.runner.graphs is not None
        # a structured output's next mask needs its token accepted by its grammar first
        free = all(req.grammar is None for req, _ in step.batch)
        return fixed_shape and free and step.decode and all(n == 1 for _, n in step.batch)

    def _launch(self, out: SchedulerOutput, device_ids: torch.Tensor | None) -> None:
        """Run a deferrable decode (its input ids from the previous decode's device tokens
        ``device_ids``, rows in the same order, or from the requests) and its sampling, and
        start copying the tokens to the host: the step in flight."""
        t0 = time.perf_counter()
        step = out.parts[0]
        runner = self.runner
        runner.prepare(out)
        result = runner.run(
            step.batch, decode=True, finishing=step.finishing, device_ids=device_ids
        )
        assert result.logits is not None
        reqs = result.sample_reqs
        tokens, raw = sample_on_device(
            result.logits, reqs, runner.eos_token_ids, pending=device_ids
        )
        lp = logprob_rows(raw, [r.params for r in reqs], tokens)
        if lp is not None:
            lp = lp.to_host()
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready: torch.cuda.Event | None = torch.cuda.Event()
            ready.record()
        else:
            host, ready = tokens, None
        # a row without a distribution (-1) fails its request when read; the next step must
        # still embed a valid id for it
        feed = tokens.clamp_min(0)
        self.inflight = InFlight(out, reqs, feed, host, lp, ready, t0)
        self.scheduler.launched(step)

    def _collect(self, f: InFlight) -> StepReport:
        """Read the tokens of the decode in flight ``f`` and record them (stops, status; its
        pages were trimmed at launch): the requests that took a token (not those that
        finished or were aborted meanwhile) and the step's statistics row."""
        if f.ready is not None:
            f.ready.synchronize()
        tokens: list[int | None] = [t if t >= 0 else None for t in f.host.tolist()]
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        if f.logprobs is not None:
            logprobs = f.logprobs.dicts([r.params for r in f.sample_reqs], tokens)
        live = [r for r in f.sample_reqs if not r.finished]
        step = f.out.parts[0]
        now = time.perf_counter()
        self.scheduler.update_from_output(step, ModelOutput(f.sample_reqs, tokens, logprobs, now))
        return live, self.stats_row(step, f.t0, now)

    def settle(self) -> None:
        """Drop the decode in flight once none of its requests is left (all finished or
        aborted): nothing would read its tokens."""
        f = self.inflight
        if f is not None and all(r.finished for r in f.sample_reqs):
            self.drain()

    def drain(self) -> None:
        f, self.inflight = self.inflight, None
        if f is not None and f.ready is not None:
            f.ready.synchronize()  # its step reads and writes the pools
