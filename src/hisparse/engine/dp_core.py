"""Data-parallel attention (docs/design.md §21): N ranks, each with its own scheduler, KV
manager, HiSparse runtime and host pool over its own requests, the MoE's experts split over
them (`hisparse.parallel.expert`).

Rank 0 (the user's `LLM`) is the front: it assigns each new request to a rank
(`DataParallelCore.route`: with prefix caching the rank it sent the longest run of the
prompt's first pages, else fewest unfinished requests, then most free GPU KV blocks, then the
lowest rank), keeps a mirror `Request` of every request another rank runs, and merges what
each step changed into them, so `generate`, `step` and the server read every rank's requests
as their own. Every step runs on every rank in lockstep: the ranks schedule on their own, then
agree in one small collective on the rows of each forward (decode part, then prefill part);
a rank with no part in a forward that runs somewhere still takes part in its MoE collectives
(`ExpertParallel.idle_forward`). After the forwards each rank sends the driver what changed
for its requests (new tokens, text, status, metrics) and its load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from hisparse.engine.core import EngineCore, EngineGauges, StepReport
from hisparse.engine.prefix_cache import page_hashes
from hisparse.engine.request import Request, Status
from hisparse.parallel.expert import all_gather_single
from hisparse.validation import _fail


def check_parallel_args(
    path: Path, tp: int, dp: int, ep: bool, gguf: bool, cuda_graphs: Any
) -> None:
    """What data parallelism cannot be combined with, and whether the ranks split the routed
    experts evenly (read from config.json before anything starts)."""
    if dp > 1 and tp > 1:
        _fail("LLM.data_parallel_size", dp, "1 when tensor_parallel_size > 1: data-parallel "
              "attention is not combined with tensor parallelism yet; pass one of "
              "them")  # fmt: skip
    if ep and dp < 2:
        _fail("LLM.enable_expert_parallel", ep, "False unless data_parallel_size > 1 (the "
              "experts are split over the data-parallel ranks)")  # fmt: skip
    if ep and gguf:
        _fail("LLM.enable_expert_parallel", ep, "False for a model without routed experts "
              "(a Llama GGUF model); a DSA MoE checkpoint takes it")  # fmt: skip
    if ep and not gguf:
        from hisparse.models.dsa_config import DsaConfig

        experts = DsaConfig.from_pretrained(path).n_routed_experts
        if experts % dp:
            ok = [d for d in range(2, experts + 1) if experts % d == 0 and d <= 64]
            _fail("LLM.data_parallel_size", dp, f"a divisor of the model's {experts} routed "
                  f"experts with enable_expert_parallel (each rank holds as many), e.g. "
                  f"{', '.join(map(str, ok))}")  # fmt: skip
    if dp > 1 and cuda_graphs:
        _fail("LLM.cuda_graphs", cuda_graphs, "False or None with data_parallel_size > 1 "
              "(the lockstep forwards run eagerly)")  # fmt: skip


def expert_share(path: Path, group: Any) -> tuple[int, int]:
    """``(first, count)``: the routed experts rank ``group.rank`` keeps (whole experts)."""
    from hisparse.models.dsa_config import DsaConfig

    per = DsaConfig.from_pretrained(path).n_routed_experts // group.world_size
    return group.rank * per, per


def expert_parallel(model: Any, group: Any) -> Any:
    """Split ``model``'s experts over ``group``'s ranks (`ExpertParallel.install`)."""
    from hisparse.parallel.expert import ExpertParallel

    ep = ExpertParallel(group, model.config.n_routed_experts, model.lm_head.weight.dtype)
    ep.install(model)
    return ep


def pick_rank(unfinished: list[int], free_blocks: list[int]) -> int:
    """The routing rule: the rank with the fewest unfinished requests, then the most free GPU
    KV blocks, then the lowest rank (`hisparse simulate --data-parallel-size` uses it too)."""
    return min(range(len(unfinished)), key=lambda r: (unfinished[r], -free_blocks[r], r))


class DataParallelCore(EngineCore):
    """`EngineCore` of one data-parallel rank (module docstring)."""

    def __init__(self, scheduler: Any, runner: Any, *, tp: Any,
                 on_fatal: Any = lambda: None) -> None:  # fmt: skip
        super().__init__(scheduler, runner, tp=tp, on_fatal=on_fatal)
        #: the model's `ExpertParallel` (None: every rank holds every expert, and the
        #: forwards need no peer)
        self.ep = getattr(runner.model, "expert_parallel", None)
        n = tp.world_size
        #: driver: unfinished requests other ranks run, by id: (rank, mirror request)
        self.remote: dict[str, tuple[int, Request]] = {}
        #: driver: each rank's free GPU KV blocks after the last step
        self.free_blocks = [0] * n
        #: requests assigned to each rank so far, and the most each ran at once (the plan's
        #: per-rank figure: tests)
        self.assigned = [0] * n
        self.peak_running = [0] * n
        #: driver: the other ranks' gauges after their last step (`gauges`)
        self.rank_gauges = [EngineGauges()] * n
        #: driver: per rank, the page hashes of the prompts sent to it (most recent last), as
        #: many as a rank's cache can hold (its pool's blocks; the oldest forgotten first)
        self.pages: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(n)]
        lay = scheduler.kv.layout
        self.pages_kept = max(lay.host_num_blocks, lay.gpu_num_blocks)
        #: worker: per request, how many tokens and text characters the driver has
        self._sent: dict[str, tuple[int, int]] = {}

    # --- requests ------------------------------------------------------------------------
    def route(self, reqs: list[Request]) -> list[int]:
        """The rank of each new request: with prefix caching, the rank whose cache most
        likely holds the longest run of its prompt's first pages (`_cached_pages`) unless
        that rank already runs a full batch more than the least loaded one; otherwise (and
        among equals) `pick_rank`: fewest unfinished requests (counting those routed just
        before it), then most free GPU KV blocks, then the lowest rank."""
        load = [len(self.scheduler.running) + len(self.scheduler.waiting), *[0] * (
            self.tp.world_size - 1)]  # fmt: skip
        for rank, _ in self.remote.values():
            load[rank] += 1
        out = []
        for req in reqs:
            hashes, cached = self._cached_pages(req)
            best = max(cached, default=0)
            ranks = [r for r, n in enumerate(cached) if n == best > 0
                     and load[r] - min(load) < self.scheduler.max_num_seqs]  # fmt: skip
            if ranks:
                rank = ranks[pick_rank([load[r] for r in ranks],
                                       [self.free_blocks[r] for r in ranks])]  # fmt: skip
            else:
                rank = pick_rank(load, self.free_blocks)
            for h in hashes:  # the pages this rank will cache
                self.pages[rank][h] = None
                self.pages[rank].move_to_end(h)
            while len(self.pages[rank]) > self.pages_kept:
                self.pages[rank].popitem(last=False)
            load[rank] += 1
            self.assigned[rank] += 1
            out.append(rank)
        return out

    def _cached_pages(self, req: Request) -> tuple[list[bytes], list[int]]:
        """The chained hashes of ``req``'s full prompt pages, and per rank how many of the
        first ones were sent to it before (an estimate of its prefix cache: it may have
        evicted some since)."""
        cache = self.scheduler.kv.prefix_cache
        if cache is None:
            return [], []
        hashes = page_hashes(req.prompt_token_ids, cache.block_size, cache.key)
        cached = []
        for pages in self.pages:
            n = 0
            while n < len(hashes) and hashes[n] in pages:
                n += 1
            cached.append(n)
        return hashes, cached

    def add(self, reqs: list[Request]) -> None:
        if any(r.grammar is not None for r in reqs):  # another rank would sample it freely
            raise ValueError(
                "SamplingParams.structured_outputs is not supported with data_parallel_size > 1 "
                "yet (only the driver holds the grammar matchers); serve it with one rank"
            )
        specs = []
        for req, rank in zip(reqs, self.route(reqs), strict=True):
            if rank == 0:
                self.scheduler.add(req)
                continue
            self.remote[req.req_id] = (rank, req)
            specs.append((rank, req.req_id, req.prompt_token_ids, req.params, req.index,
                          req.sampling_seed))  # fmt: skip
        if specs:
            with self.tp_section():
                self.tp.send(("add", specs))

    def add_from_driver(self, specs: list[Any]) -> None:
        for rank, rid, ids, params, index, seed in specs:
            if rank == self.tp.rank:
                req = Request(req_id=rid, prompt_token_ids=ids, params=params, index=index)
                req.sampling_seed = seed  # the driver's stream: a rank draws what one would
                self.scheduler.add(req)

    def abort(self, reqs: list[Request]) -> None:
        ids = []
        for req in reqs:
            if req.req_id in self.remote:
                del self.remote[req.req_id]
                ids.append(req.req_id)
                req.status, req.finish_reason = Status.FINISHED, "abort"
            elif not req.finished:
                self.scheduler.abort(req)
        if ids:
            with self.tp_section():
                self.tp.send(("abort", ids))

    def abort_from_driver(self, ids: list[str]) -> None:
        super().abort_from_driver(ids)
        for rid in ids:
            self._sent.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.remote)

    def gauges(self) -> EngineGauges:
        """The node's gauges (the server's ``/metrics`` show the node, as vLLM's summed over
        its engines): this rank's now plus every other rank's after its last step, whose
        running and waiting counts are capped by the requests it still has here (an abort
        between steps leaves them at once; its blocks come back with the next step)."""
        mine = [0] * self.tp.world_size
        for rank, _ in self.remote.values():
            mine[rank] += 1
        total = EngineGauges.of(self.scheduler)
        for g, n in zip(self.rank_gauges[1:], mine[1:], strict=True):
            waiting = min(g.waiting, n)
            total += dataclasses.replace(g, waiting=waiting, running=min(g.running, n - waiting))
        return total

    def unfinished(self) -> list[Request]:
        return [*super().unfinished(), *(req for _, req in self.remote.values())]

    # --- a step in lockstep ----------------------------------------------------------------
    def step(self) -> list[StepReport]:
        tp, sched = self.tp, self.scheduler
        if tp.is_driver:
            tp.send(("step",))
        t0 = time.perf_counter()
        out = sched.schedule()
        self.runner.prepare(out)
        parts = {p.decode: p for p in out.parts}
        # a synthetic prefill (benchmarks) runs no forward, on any rank: nothing to agree on
        hooks = self.runner.hooks
        synthetic = hooks is not None and hooks.synthetic_prefill
        counts = self._agree([sum(n for _, n in parts[d].batch) if d in parts and not
                              (synthetic and not d) else 0 for d in (True, False)])  # fmt: skip
        reports: list[StepReport] = []
        for i, decode in enumerate((True, False)):
            n = max(c[i] for c in counts)  # the forward's padded rows
            node = sum(c[i] for c in counts)  # its tokens over the node
            part = parts.get(decode)
            if not n and part is None:
                continue
            agreed = self.ep is not None and n > 0
            with self.ep.forward_rows(n) if agreed else contextlib.nullcontext():
                if part is None:
                    if self.ep is not None:
                        self.ep.idle_forward()
                    if tp.is_driver:  # the node's forward, which rank 0 sat out
                        now = time.perf_counter()
                        start, self._last_end = max(t0, self._last_end), now
                        running = node if decode else len(sched.running)
                        row = dict(decode=float(decode), tokens=node, seconds=now - start,
                                   running=running, end=now)  # fmt: skip
                        reports.append(([], row))
                        t0 = now
                    continue
                result = self.runner.execute_part(part)
            sched.update_from_output(part, result)
            row = self.stats_row(part, t0, result.now)
            row.update(dp_rows=float(n), tokens=node)  # statistics of the node's forward
            if decode:
                row["running"] = node  # one row per decoding request
            reports.append((part.requests, row))
            t0 = result.now
        return self._exchange(reports)

    def _agree(self, mine: list[int]) -> list[list[int]]:
        """Every rank's rows of each forward (one small all-gather): a forward runs padded to
        the most any rank has; the sums are the node's statistics."""
        tp = self.tp
        dev = tp.device if tp.backend == "nccl" else torch.device("cpu")
        buf = torch.tensor(mine, dtype=torch.int64, device=dev)
        out = torch.empty(tp.world_size * len(mine), dtype=torch.int64, device=dev)
        all_gather_single(out, buf, group=tp.group)
        return out.view(tp.world_size, len(mine)).tolist()

    def _exchange(self, reports: list[StepReport]) -> list[StepReport]:
        """Every rank's changed requests and load to the driver, which updates its mirrors;
        the driver's reports gain the other ranks' changed requests."""
        tp, sched = self.tp, self.scheduler
        load = (sched.kv.gpu_blocks.num_free, len(sched.running), EngineGauges.of(sched))
        # the swap counters into each request's metrics now (a worker's before its deltas;
        # the driver's onto its own decode rows: the rows of forwards it sat out have none)
        counters = iter(self.runner.flush_metrics())
        if tp.is_driver:
            for reqs, row in reports:
                if row["decode"] and reqs:
                    row.update(next(counters, {}))
            gathered = tp.gather((load, []))
            assert gathered is not None
            changed = []
            for rank, ((rank_free, running, gauges), deltas) in enumerate(gathered):
                self.free_blocks[rank], self.rank_gauges[rank] = rank_free, gauges
                self.peak_running[rank] = max(self.peak_running[rank], running)
                for delta in deltas:
                    req = self._apply(delta)
                    if req is not None:
                        changed.append(req)
            if changed:
                if reports:
                    reports[-1][0].extend(changed)
                else:
                    now = time.perf_counter()
                    row = dict(decode=0.0, tokens=0, running=0, seconds=0.0, end=now)
                    reports.append((changed, row))
            return reports
        mine: dict[int, Request] = {id(r): r for reqs, _ in reports for r in reqs}
        mine.update((id(r), r) for r in sched.failed)
        sched.failed.clear()
        tp.gather((load, [self._delta(r) for r in mine.values()]))
        return reports

    def _delta(self, req: Request) -> tuple[Any, ...]:
        """What the driver's mirror of ``req`` lacks: new tokens (and logprobs), the text
        (from the first new character; whole once finished), status and metrics."""
        ntok, nchar = self._sent.get(req.req_id, (0, 0))
        ntok = min(ntok, len(req.output_token_ids))
        nchar = 0 if req.finished or nchar > len(req.text) else nchar
        lps = req.logprobs[ntok:] if req.logprobs is not None else None
        if req.finished:
            self._sent.pop(req.req_id, None)
        else:
            self._sent[req.req_id] = (len(req.output_token_ids), len(req.text))
        return (req.req_id, ntok, req.output_token_ids[ntok:], lps, req.cumulative_logprob,
                nchar, req.text[nchar:], req.status.value, req.finish_reason, req.error,
                req.stop_reason, req.num_computed, req.metrics)  # fmt: skip

    def _apply(self, delta: tuple[Any, ...]) -> Request | None:
        (rid, ntok, toks, lps, cum, nchar, text, status, reason, error, stop, computed,
         metrics) = delta  # fmt: skip
        entry = self.remote.get(rid)
        if entry is None:
            return None  # aborted here meanwhile
        req = entry[1]
        req.output_token_ids[ntok:] = toks
        if lps is not None and req.logprobs is not None:
            req.logprobs[ntok:] = lps
        req.cumulative_logprob = cum
        req.text = req.text[:nchar] + text
        req.status, req.finish_reason, req.error = Status(status), reason, error
        metrics.arrival = req.metrics.arrival  # the caller's (the server sets it after adding)
        req.stop_reason, req.num_computed, req.metrics = stop, computed, metrics
        if req.finished:
            del self.remote[rid]
        return req
