"""The lightning indexer's top-k: the Triton radix select against ``torch.topk``.

Rows of 128K (and 32K) fp32 scores, ``top_k`` 2048, at the decode batches of one layer (1, 8,
29, 64 rows) and a prefill row block (2048 rows), in three distributions: ``spread`` (standard
normal: both signs, many binades), ``crowded`` (normal around 10 with unit spread: nearly
every key in one binade, so that the first byte, sign and exponent, tells few apart, as sums
of ReLU terms can crowd) and ``relu`` (the lightning indexer's form: 64 heads' ReLU'd dot
products of random 128-dim queries and keys, summed with random signed head weights), with
the keys per row at or above the select's floor from group maxima. Each case first checks the
select against `topk_select_reference` (exact) and against ``torch.topk``'s set, then times,
as medians of CUDA-graph replays of 10 calls each (what a captured decode step pays, without
a graph launch per call; `hisparse.testing.cuda_graphs.graph_call_us`):

- ``torch``: ``torch.topk`` + the ``-inf`` -> ``-1`` mapping (the path before the select);
- ``select``: `topk_select_triton`; ``no floor``: the same counting every key (and with
  ``--sweep-sparse``, up to 29 rows, the same at other `SPARSE_KEYS`: up to how many
  matching keys a block adds one atomic each instead of a histogram; with ``--sweep-parts``,
  8 to 64 rows, at other programs per SM; with ``--sweep-floor``, calls that take the
  floor, at other `FLOOR_CAND_BLOCK` and `FLOOR_BYTE_BLOCK`);
- ``no PDL``: the same with ``HISPARSE_PDL=0`` (each launch waits for the one before to
  end, instead of starting as a programmatic dependent while it finishes);
- ``before``: with ``--baseline FILE``, another version's ``topk_select_triton`` (a module
  file, e.g. ``git show HEAD~1:src/hisparse/attention/topk_triton.py``), checked and timed
  beside in the same process;
- with ``--launches``, each kernel's device time per call (torch.profiler, programmatic
  dependent launches off so that no kernel's time holds its wait for the one before);
- ``read``: the bytes the select must read once (``rows x keys x 4 B``) at the HBM copy rate
  measured in the same run (1 GiB copy): the floor of any top-k.

Writes ``$OUT/bench_topk.json`` when ``OUT`` is set; prints the table last.

    PYTHONPATH=src python3 benchmarks/bench_topk.py [--baseline old_topk.py] [--launches]
        [--cases 29x131072,...] [--dists spread,crowded] [--sweep-sparse] [--sweep-parts]
        [--sweep-floor]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import triton.testing

from bench_indexer import baseline_function  # (this script's folder is on sys.path)
from hisparse.attention import topk_floor, topk_triton
from hisparse.attention.indexer_triton import topk_from_scores
from hisparse.attention.topk_triton import topk_select_reference, topk_select_triton
from hisparse.testing.cuda_graphs import graph_call_us as _graph_us

K = 2048
#: ``--sweep-parts``: programs per SM over the call (the default: `topk_triton.PROGRAMS_PER_SM`).
PARTS_PER_SM = (1, 2, 4, 8, 16)
CASES = [(1, 131072), (8, 131072), (29, 131072), (64, 131072), (2048, 131072), (1, 32768),
         (29, 32768)]  # fmt: skip
DISTS = ("spread", "crowded", "relu")
#: ``--sweep-floor``: (candidates an iteration of the launches after the floor's compaction,
#: group maxima an iteration of its second launch).
FLOOR_SWEEP = [(256, 1024), (512, 1024), (1024, 1024), (2048, 1024), (512, 128)]


def _scores(t: int, s: int, dist: str, dev: torch.device) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(t * 7 + s)
    if dist == "relu":  # sum_h w_h * relu(q_h . k), the indexer's score
        keys = torch.randn(s, 128, generator=g, device=dev)
        x = torch.empty(t, s, device=dev)
        for r in range(t):
            q = torch.randn(64, 128, generator=g, device=dev)
            w = torch.randn(64, generator=g, device=dev)
            x[r] = w @ torch.relu(q @ keys.T)
        return x
    x = torch.randn(t, s, generator=g, device=dev)
    return x if dist == "spread" else x + 10.0


def _floor_keys(x: torch.Tensor) -> float:
    """Mean keys per row at or above the floor the select computes."""
    group = topk_floor._floor_group(x.shape[1], K)
    if not group:
        return float(x.shape[1])
    return topk_floor.floor_counts_reference(x, K, group).float().mean().item()


def _torch_topk(x: torch.Tensor, out: torch.Tensor) -> None:
    vals, idx = x.topk(K, dim=-1)
    out.copy_(torch.where(torch.isneginf(vals), -1, idx).to(torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="a module file whose topk_select_triton runs beside")
    ap.add_argument("--sweep-sparse", action="store_true", help="time other SPARSE_KEYS too")
    ap.add_argument("--cases", help="ROWSxKEYS,... instead of the default cases")
    ap.add_argument("--dists", default=",".join(DISTS), help="score distributions to run")
    ap.add_argument(
        "--launches", action="store_true", help="each launch's time (torch.profiler), per case"
    )
    ap.add_argument(
        "--sweep-floor", action="store_true", help="time other floor launch shapes (16-64 rows)"
    )
    ap.add_argument(
        "--sweep-parts", action="store_true", help="time other programs per SM (8-64 rows)"
    )
    args = ap.parse_args()
    before = baseline_function(args.baseline, "topk_select_triton")
    dev = torch.device("cuda")
    src = torch.empty(2**28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_gb_s = 2 * src.numel() * 4 / copy_ms / 1e6  # read + write
    src = dst = None  # freed
    rows, sweep = [], []
    default_sparse = topk_triton.SPARSE_KEYS
    cases = CASES
    if args.cases:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    for (t, s), dist in ((c, d) for d in args.dists.split(",") for c in cases):
        if dist != "spread" and t > 64:  # (a prefill block: torch.topk in the engine)
            continue
        x = _scores(t, s, dist, dev)
        out = torch.full((t, K), -7777, dtype=torch.int32, device=dev)
        topk_select_triton(x, K, out)
        want = topk_select_reference(x, K)
        exact = torch.equal(out, want)
        same_set = torch.equal(out.sort(dim=1).values, x.topk(K, dim=1).indices.sort(dim=1).values)
        picked = topk_from_scores(x, K).sort(dim=1).values  # the select up to SELECT_MAX_ROWS
        assert picked.equal(out.sort(dim=1).values), "the indexer's top-k picks another set"
        t_torch = _graph_us(lambda x=x, out=out: _torch_topk(x, out))
        t_sel = _graph_us(lambda x=x, out=out: topk_select_triton(x, K, out))
        out.fill_(-7777)
        exact = exact and torch.equal(topk_select_triton(x, K, out, floor=False), want)
        t_no_floor = _graph_us(lambda x=x, out=out: topk_select_triton(x, K, out, floor=False))
        os.environ["HISPARSE_PDL"] = "0"
        t_no_pdl = _graph_us(lambda x=x, out=out: topk_select_triton(x, K, out))
        del os.environ["HISPARSE_PDL"]
        t_before = None
        if before is not None:
            out.fill_(-7777)
            exact = exact and torch.equal(before(x, K, out), want)
            t_before = _graph_us(lambda x=x, out=out: before(x, K, out))
        read_us = t * s * 4 / copy_gb_s / 1e3
        rows.append(dict(rows=t, keys=s, dist=dist, exact=exact, same_set_as_torch=same_set,
                         torch_us=t_torch, select_us=t_sel, no_pdl_us=t_no_pdl,
                         no_floor_us=t_no_floor, floor_keys=_floor_keys(x),
                         before_us=t_before, read_us=read_us,
                         speedup=t_torch / t_sel, copy_gb_s=copy_gb_s))  # fmt: skip
        print(rows[-1], flush=True)
        if args.sweep_sparse and t <= 29:  # single atomics up to SPARSE_KEYS keys, or histograms
            try:
                for sparse in (0, 16, 256, 2048):
                    topk_triton.SPARSE_KEYS = sparse
                    out.fill_(-7777)
                    ok = torch.equal(topk_select_triton(x, K, out), want)
                    us = _graph_us(lambda x=x, out=out: topk_select_triton(x, K, out))
                    sweep.append(
                        dict(dist=dist, rows=t, keys=s, sparse_keys=sparse, select_us=us, exact=ok)
                    )
                    print(sweep[-1], flush=True)
            finally:
                topk_triton.SPARSE_KEYS = default_sparse
        if args.launches:
            rows[-1]["launches_us"] = _launch_us(lambda x=x, out=out: topk_select_triton(x, K, out))
            rows[-1]["no_floor_launches_us"] = _launch_us(
                lambda x=x, out=out: topk_select_triton(x, K, out, floor=False)
            )
            if before is not None:
                rows[-1]["before_launches_us"] = _launch_us(lambda x=x, out=out: before(x, K, out))
            for key in ("launches_us", "no_floor_launches_us", "before_launches_us"):
                print(f"  {key}:", rows[-1].get(key))
        if args.sweep_parts and 8 <= t <= 64:  # programs per row: about f per SM over the call
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            for f in PARTS_PER_SM:
                p = max(1, min(-(-f * sms // t), s // topk_triton.MIN_PART))
                out.fill_(-7777)
                ok = torch.equal(topk_select_triton(x, K, out, parts=p), want)
                us = _graph_us(lambda x=x, out=out, p=p: topk_select_triton(x, K, out, parts=p))
                sweep.append(
                    dict(dist=dist, rows=t, keys=s, per_sm=f, parts=p, select_us=us, exact=ok)
                )
                print(sweep[-1], flush=True)
        if args.sweep_floor and topk_floor.FLOOR_MIN_ROWS <= t <= topk_floor.FLOOR_MAX_ROWS:
            saved = topk_triton.FLOOR_CAND_BLOCK, topk_triton.FLOOR_BYTE_BLOCK
            try:
                for shape in FLOOR_SWEEP:
                    topk_triton.FLOOR_CAND_BLOCK, topk_triton.FLOOR_BYTE_BLOCK = shape
                    out.fill_(-7777)
                    ok = torch.equal(topk_select_triton(x, K, out), want)
                    us = _graph_us(lambda x=x, out=out: topk_select_triton(x, K, out))
                    sweep.append(dict(dist=dist, rows=t, keys=s, floor_shape=shape,
                                      select_us=us, exact=ok))  # fmt: skip
                    print(sweep[-1], flush=True)
            finally:
                topk_triton.FLOOR_CAND_BLOCK, topk_triton.FLOOR_BYTE_BLOCK = saved
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_topk.json").write_text(json.dumps(rows + sweep, indent=2))
    for r in sweep:
        if "floor_shape" in r:
            print(
                f"  {r['dist']:8s} {r['rows']:5d} {r['keys']:7d}: candidates / maxima an"
                f" iteration {r['floor_shape'][0]:4d} / {r['floor_shape'][1]:4d}"
                f" -> {r['select_us']:7.1f}"
                f"{'' if r['exact'] else '  NOT EXACT'}"
            )
            continue
        if "sparse_keys" in r:
            print(
                f"  {r['dist']:8s} {r['rows']:5d} {r['keys']:7d}: SPARSE_KEYS"
                f" {r['sparse_keys']:4d} -> {r['select_us']:7.1f}"
                f"{'' if r['exact'] else '  NOT EXACT'}"
            )
            continue
        print(
            f"  {r['dist']:8s} {r['rows']:5d} {r['keys']:7d}: {r['per_sm']:2d}/SM"
            f" ({r['parts']:4d} parts) -> {r['select_us']:7.1f}"
            f"{'' if r['exact'] else '  NOT EXACT'}"
        )
    print(f"\nHBM copy {copy_gb_s:.0f} GB/s; top_k {K}; medians of CUDA-graph replays, µs")
    head = ["scores", "rows", "keys", "exact", "keys >= floor", "torch.topk µs", "before µs",
            "no PDL µs", "no floor µs", "select µs", "speedup", "read µs",
            "select / read"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['dist']} | {r['rows']} | {r['keys']} | "
              f"{r['exact'] and r['same_set_as_torch']} | "
              f"{r['floor_keys']:.0f} | "
              f"{r['torch_us']:.1f} | {_us(r['before_us'])} | {r['no_pdl_us']:.1f} | "
              f"{r['no_floor_us']:.1f} | {r['select_us']:.1f} | "
              f"{r['speedup']:.2f}x | "
              f"{r['read_us']:.2f} | {r['select_us'] / r['read_us']:.1f}x |")  # fmt: skip


def _launch_us(fn: Callable[[], object], reps: int = 20) -> dict[str, float]:
    """Mean device time of each kernel ``fn`` launches (µs per call), by kernel name; without
    programmatic dependent launches, whose early start would count the wait for the launch
    before in each kernel's time."""
    from torch.profiler import ProfilerActivity, profile

    os.environ["HISPARSE_PDL"] = "0"
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    finally:
        del os.environ["HISPARSE_PDL"]
    return {
        e.key: round(e.device_time_total / reps, 2)
        for e in prof.key_averages()
        if e.device_time_total > 0 and "Memcpy" not in e.key
    }


def _us(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()
