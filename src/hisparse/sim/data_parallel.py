"""``hisparse simulate --data-parallel-size N``: a trace over N data-parallel ranks
(docs/design.md §21). Each rank is a `Simulator` with its own scheduler, KV manager and host
pool; each arriving request goes to the rank the engine's rule picks (`pick_rank`: fewest
unfinished requests, then most free GPU KV blocks); the ranks' forwards run in lockstep, so a
step's decode forward takes the slowest rank's time, then its prefill forward likewise (a rank
with nothing to run waits). The MoE's collectives are not timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hisparse.engine.dp_core import pick_rank
from hisparse.engine.request import Request
from hisparse.engine.sampling_params import SamplingParams
from hisparse.sim.simulator import STEP_COLUMNS, SimSettings, Simulator
from hisparse.sim.trace import TraceRequest


def simulate_data_parallel(
    settings: SimSettings,
    trace: list[TraceRequest],
    ranks: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Play ``trace`` through ``ranks`` fresh simulated engines of ``settings`` (each rank's
    own pools and ``max_num_seqs``); the node's summary under the single run's names, plus
    ``per_rank`` (each rank's summary) and ``routed`` (requests per rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(settings, trace, ranks, progress)
    finally:
        torch.set_num_threads(threads)


def _run(settings: SimSettings, trace: list[TraceRequest], ranks: int,
         progress: Callable[[int, int], None] | None) -> dict[str, Any]:  # fmt: skip
    t_wall = time.perf_counter()
    sims = [Simulator(settings) for _ in range(ranks)]
    for sim in sims:
        sim.clock, sim.admitted = 0.0, {}
    reqs: list[list[Request]] = [[] for _ in sims]
    steps: list[list[list[float]]] = [[] for _ in sims]
    node: list[list[float]] = []  # per lockstep forward, `STEP_COLUMNS` over the ranks
    clock, total, i, stalls, done = 0.0, len(trace), 0, 0, 0
    while i < total or any(s.sched.has_work for s in sims):
        while i < total and trace[i].arrival <= clock:
            load = [len(s.sched.running) + len(s.sched.waiting) for s in sims]
            rank = pick_rank(load, [s.kv.gpu_blocks.num_free for s in sims])
            t = trace[i]
            req = Request(
                req_id=str(settings.id_offset + i),
                prompt_token_ids=range(t.input_len),  # type: ignore[arg-type]  # only len()
                params=SamplingParams(temperature=0, max_tokens=t.output_len, ignore_eos=True),
            )
            req.metrics.arrival = t.arrival
            sims[rank].sched.add(req)
            reqs[rank].append(req)
            i += 1
        if not any(s.sched.has_work for s in sims):
            clock = trace[i].arrival
            continue
        for sim in sims:
            sim.clock = clock
        parts = []
        for sim in sims:
            parts.append({p.decode: p for p in sim.sched.schedule().parts})
            sim._lease_resets()
        if not any(parts):
            stalls += 1
            if stalls > total + 2:
                raise RuntimeError("scheduler stalled: nothing fits and nothing runs")
            continue
        stalls = 0
        for decode in (True, False):
            runs = [(r, p[decode]) for r, p in enumerate(parts) if decode in p]
            if not runs:
                continue
            stats = [(r, part, sims[r].forward(part)) for r, part in runs]
            secs = max(st["secs"] for _, _, st in stats)
            t0, clock = clock, clock + secs
            rows = []
            for r, part, st in stats:
                sims[r].clock = clock
                rows.append(sims[r].finish(part, st, t0))
                steps[r].append(rows[-1])
            row = [sum(col) for col in zip(*rows, strict=True)]  # tokens .. bytes: the node's
            row[0], row[1], row[-1] = round(t0, 6), float(decode), round(secs, 9)
            row[4] = sum(len(s.sched.waiting) for s in sims)
            row[-2] = max(r[-2] for r in rows)  # PCIe: each rank's own link
            node.append(row)
        for sim in sims:
            sim.sched.failed.clear()
            sim.clock = clock
        new_done = sum(len(rq) for rq in reqs) - sum(
            len(s.sched.running) + len(s.sched.waiting) for s in sims)  # fmt: skip
        if progress is not None and new_done > done:
            progress(new_done, total)
        done = new_done
    wall = time.perf_counter() - t_wall
    per_rank = [sim._summary(rq, st, wall) for sim, rq, st in zip(sims, reqs, steps, strict=True)]
    return _node_summary(settings, sims, reqs, per_rank, node, clock, wall)


def _node_summary(settings: SimSettings, sims: list[Simulator], reqs: list[list[Request]],
                  per_rank: list[dict[str, Any]], node: list[list[float]],
                  clock: float, wall: float) -> dict[str, Any]:  # fmt: skip
    dec = [f for f in node if f[1]]
    dec_s = sum(f[10] for f in dec)
    hits = sum(r["hits"] for r in per_rank)
    misses = sum(r["misses"] for r in per_rank)
    nbytes = sum(r["bytes_swapped"] for r in per_rank)
    waits = [s.admitted[q.req_id] - q.metrics.arrival for s, rq in zip(sims, reqs, strict=True)
             for q in rq if q.req_id in s.admitted]  # fmt: skip

    def pct(v: list[float], q: float) -> float | None:
        return float(np.percentile(v, 100 * q)) if v else None

    for r in per_rank:
        r.pop("steps", None)
    return dict(
        placement=settings.placement,
        data_parallel_size=len(sims),
        requests=sum(len(rq) for rq in reqs),
        routed=[len(rq) for rq in reqs],
        completed=sum(r["completed"] for r in per_rank),
        errors=[e for r in per_rank for e in r["errors"]],
        preemptions=sum(r["preemptions"] for r in per_rank),
        peak_running=max((int(f[3]) for f in dec), default=0),
        mean_running=float(np.mean([f[3] for f in dec])) if dec else 0.0,
        decode_steps=len(dec),
        decode_seconds=dec_s,
        decode_tok_s=sum(f[2] for f in dec) / dec_s if dec_s > 0 else 0.0,
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        bytes_swapped=nbytes,
        h2d_gb_s=nbytes / dec_s / 1e9 if dec_s > 0 else 0.0,  # over the ranks' own links
        pcie_fraction=max((r["pcie_seconds"] for r in per_rank), default=0.0) / dec_s
        if dec_s > 0
        else 0.0,
        simulated_seconds=clock,
        admission_wait_p50=pct(waits, 0.5),
        admission_wait_p95=pct(waits, 0.95),
        admission_wait_max=max(waits, default=None),
        wall_seconds=wall,
        per_rank=per_rank,
        step_columns=list(STEP_COLUMNS),
        steps=node,
    )
