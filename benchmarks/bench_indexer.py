"""Lightning indexer per decode step: Triton score kernel + torch.topk against the reference.

DeepSeek-V3.2 sizes (64 heads x 128 dims, index_topk 2048, block size 64), one decode token per
request, every request at the same context; batch 1 / 8 / 29 / 64 at 32K and 128K tokens. For
each case it first checks the kernel (default config and `OLD_FP8_CONFIG`) against the reference
(`indexer_cases.selection_errors`, tolerance as in tests/gpu/test_indexer_gpu.py; it stops at
the first failure), then times:

- ``reference``: `indexer_topk_paged_reference` (the model's path before the kernel);
- ``triton``: `indexer_topk_paged_triton`, eager (score kernel, then torch.topk);
- ``graph``: the same captured in one CUDA graph (what a graph-captured decode step pays);
- ``scores`` / ``topk``: the two stages alone (eager).

- ``old`` / ``new``: the score stage with `OLD_FP8_CONFIG` (the first kernel) and the default;
- the `VARIANTS` sweep: the score stage per config (and keys per program), with its error;
- ``before``: with ``--baseline FILE``, another version's score stage (a module file holding
  ``indexer_scores_paged_triton``, e.g. ``git show REV:src/hisparse/attention/indexer_triton.py``)
  at its own default config, checked like the rest and timed in three rounds alternating with
  the current default;
- with ``--maxima``: scores + top-k in CUDA graphs, the indexer's call (the score kernel writes
  the top-k floor's group maxima) against the two stages called apart.

Times are medians of `triton.testing.do_bench` (which flushes L2 between runs), in µs.
``GB/s`` is the score stage's key bytes (``contexts x 132 B``) over its time; ``% copy`` puts it
against a same-run HBM copy (``2 x bytes`` read and written over the copy's time, 1 GiB). Exact
mode (fp32 keys) runs at batch 8 only. Writes ``$OUT/bench_indexer.json`` when ``OUT`` is set.

    PYTHONPATH=src python3 benchmarks/bench_indexer.py [--quick] [--no-sweep] [--baseline FILE]
        [--cases 29x131072,64x131072] [--maxima]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton.testing

from hisparse.attention import indexer_triton as it
from hisparse.attention.indexer_reference import indexer_topk_paged_reference
from hisparse.testing import indexer_cases as ic
from hisparse.testing.cuda_graphs import graph_call_us

H, D, K, BS = 64, 128, 2048, 64
RTOL, ATOL = 1e-4, 1e-6
DEVICE = "cuda"


def _us(fn, rep: int = 100) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def copy_GBps() -> float:
    """HBM bandwidth of a 1 GiB device-to-device copy (bytes read + written per second)."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = _us(lambda: dst.copy_(src), rep=200)
    return 2 * n / (us * 1e3)


def _score_err(s: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    return float(((s - ref).abs().masked_fill(~torch.isfinite(ref), 0) / tol).max())


def baseline_function(path: str | None, name: str):
    """Function ``name`` of the module file at ``path``, another version of one of ours timed
    beside it (None without a path)."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def run_case(
    kind: str, batch: int, context: int, seed: int, sweep: bool, before=None, stages=(),
    maxima: bool = False,
) -> dict:  # fmt: skip
    dev = torch.device(DEVICE)
    case = ic.random_indexer_case(
        kind,
        [context] * batch,
        [1] * batch,
        heads=H,
        head_dim=D,
        block_size=BS,
        device=dev,
        seed=seed,
    )
    args = case.args()

    def triton_topk() -> torch.Tensor:
        return it.indexer_topk_paged_triton(*args, K, case.softmax_scale)

    def scores(cfg: it.IndexerConfig | None = None) -> torch.Tensor:
        return it.indexer_scores_paged_triton(*args, case.softmax_scale, config=cfg)

    def reference() -> torch.Tensor:
        return indexer_topk_paged_reference(*args, case.seq_lens, K, case.softmax_scale)

    # Correctness first: the default config and, for fp8, the first kernel's.
    got = triton_topk()
    s = scores()
    ref = ic.reference_scores(case, s.shape[1])
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    err = _score_err(s, ref, tol)
    errors = ic.selection_errors(got, ref, case.limits, K, tol)
    old = it.OLD_FP8_CONFIG if kind == "fp8" else it.default_config("fp32")
    s_old = scores(old)
    err_old = _score_err(s_old, ref, tol)
    errors += ic.selection_errors(it.topk_from_scores(s_old, K), ref, case.limits, K, tol)
    if max(err, err_old) > 1.0 or errors:
        raise SystemExit(
            f"{kind} batch {batch} ctx {context}: score error {err:.3g} x tol (old config "
            f"{err_old:.3g}), {errors}"
        )
    want = reference()
    overlap = _overlap(got, want)
    del want

    sc = s.clone()
    row = {
        "kind": kind,
        "batch": batch,
        "context": context,
        "score_err_over_tol": err,
        "old_score_err_over_tol": err_old,
        "set_overlap_vs_reference": overlap,
        "reference_us": _us(reference),
        "triton_us": _us(triton_topk),
        "graph_us": graph_call_us(triton_topk, calls=1),
        "old_scores_us": _us(lambda: scores(old)),
        "scores_us": _us(scores),
        "topk_us": _us(lambda: it.topk_from_scores(sc, K)),
        "chunk": it.chunk_for(batch, context, it.default_config(case.fmt.kind).block_n, dev),
    }
    key_bytes = batch * context * case.fmt.row_bytes
    row["score_GBps"] = key_bytes / (row["scores_us"] * 1e3)
    row["old_score_GBps"] = key_bytes / (row["old_scores_us"] * 1e3)
    row["speedup_vs_reference"] = row["reference_us"] / row["triton_us"]
    compiled = it.last_compiled[0]  # the default config's kernel (timed last above)
    if compiled is not None and hasattr(compiled, "n_regs"):
        row["regs"], row["spills"] = compiled.n_regs, compiled.n_spills
    if before is not None:

        def fn_before() -> torch.Tensor:
            return before(*args, case.softmax_scale)

        row["before_err_over_tol"] = _score_err(fn_before(), ref, tol)
        # Three alternating rounds, the median of each side: runs drift within a process.
        rounds = [(_us(fn_before), _us(scores)) for _ in range(3)]
        row["before_scores_us"] = sorted(b for b, _ in rounds)[1]
        row["ab_scores_us"] = sorted(a for _, a in rounds)[1]
        row["before_GBps"] = key_bytes / (row["before_scores_us"] * 1e3)
        row["ab_GBps"] = key_bytes / (row["ab_scores_us"] * 1e3)
    if kind == "fp8" and sweep:
        row["variants"] = _variants(case, ref, tol, key_bytes)
    if kind == "fp8" and stages:
        row["gluon"] = _gluon_stages(case, ref, tol, key_bytes, stages)
    if maxima:
        row["maxima"] = _maxima_handoff(case, got)
    return row


def _maxima_handoff(case: ic.PagedIndexerCase, want: torch.Tensor) -> dict:
    """Scores + top-k in CUDA graphs (ten calls a graph, three alternating rounds, medians):
    the indexer's call, where the score kernel writes the top-k floor's group maxima
    (`indexer_triton.select_maxima`), against the two stages called apart (the select finds
    the maxima itself). Each picks ``want``'s picks."""
    args, pos, req = case.args(), case.positions, case.req_index

    def handed() -> torch.Tensor:
        return it.indexer_topk_paged_triton(*args, K, case.softmax_scale)

    def apart() -> torch.Tensor:
        s = it.indexer_scores_paged_triton(*args, case.softmax_scale)
        return it.topk_from_scores(s, K, positions=pos, req_index=req)

    fns = {"handed": handed, "apart": apart}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            if not torch.equal(fn(), want):
                raise SystemExit(f"maxima hand-off {name}: picks differ")
            times[name].append(graph_call_us(fn))
    return {f"{name}_us": sorted(v)[1] for name, v in times.items()}


def _gluon_stages(
    case: ic.PagedIndexerCase, ref: torch.Tensor, tol: torch.Tensor, key_bytes: int, stages
) -> dict:
    """The Gluon score kernel (`indexer_gluon`) at each ring depth, beside the Triton kernel
    (the default config passed explicitly), three alternating rounds each of ten calls in one
    CUDA graph; its error and its largest difference from the Triton scores."""
    from hisparse.attention import indexer_gluon as ig

    def triton_fn() -> torch.Tensor:
        return it.indexer_scores_paged_triton(
            *case.args(), case.softmax_scale, config=it.IndexerConfig()
        )

    def gluon_fn() -> torch.Tensor:
        return it.indexer_scores_paged_triton(*case.args(), case.softmax_scale)

    want = triton_fn()
    saved = ig.STAGES, ig.PROGRAMS_PER_SM, ig.MAX_REGS
    out = {}
    try:
        for spec in stages:
            n, per_sm, regs = (*spec, None, None)[:3]
            ig.STAGES = n
            if per_sm is None:
                smem = 2 * H * D + n * (BS * case.fmt.row_bytes) + 2048
                per_sm = max(1, min(4, 232448 // smem))
            ig.PROGRAMS_PER_SM, ig.MAX_REGS = per_sm, regs
            got = gluon_fn()
            finite = torch.isfinite(ref)
            rounds = [(graph_call_us(triton_fn), graph_call_us(gluon_fn)) for _ in range(3)]
            name = ":".join(str(v) for v in spec)
            out[name] = {
                "per_sm": ig.PROGRAMS_PER_SM,
                "triton_us": sorted(a for a, _ in rounds)[1],
                "gluon_us": sorted(b for _, b in rounds)[1],
                "err_over_tol": _score_err(got, ref, tol),
                "max_diff_vs_triton": float((got - want).abs()[finite].max()),
                "neginf_equal": bool(torch.equal(torch.isneginf(got), torch.isneginf(want))),
                "regs": getattr(it.last_compiled[0], "n_regs", None),
            }
            out[name]["GBps"] = key_bytes / (out[name]["gluon_us"] * 1e3)
            out[name]["triton_GBps"] = key_bytes / (out[name]["triton_us"] * 1e3)
    finally:
        ig.STAGES, ig.PROGRAMS_PER_SM, ig.MAX_REGS = saved
    return out


#: Score-stage configurations swept besides the default (``chunk_x2`` / ``chunk_half``: the
#: default config with twice / half the default keys per program). Those with exact (f16 /
#: bf16) dots are the ones tests/gpu/test_indexer_gpu.py checks as well.
VARIANTS: dict[str, it.IndexerConfig] = {
    "old": it.OLD_FP8_CONFIG,
    "f16_perkey_s3": it.IndexerConfig(page_tiles=False, num_stages=3),
    "f16_perkey_s5": it.IndexerConfig(page_tiles=False, num_stages=5),
    "bf16_page_s5": it.IndexerConfig(dot="bf16"),
    "page_s3": it.IndexerConfig(num_stages=3),
    "page_s4": it.IndexerConfig(num_stages=4),
    "page_s7": it.IndexerConfig(num_stages=7),
    "chunk_x2": it.IndexerConfig(),
    "chunk_half": it.IndexerConfig(),
    "fp8dot": it.IndexerConfig(dot="fp8"),
    "fp8dot_acc32": it.IndexerConfig(dot="fp8", fp8_acc_k=32),
    "fp8dot_acc64": it.IndexerConfig(dot="fp8", fp8_acc_k=64),
    "no_permute_k": it.IndexerConfig(permute_k=False),
    "maxnreg96_5sm": it.IndexerConfig(maxnreg=96, programs_per_sm=5),
    "maxnreg80_6sm": it.IndexerConfig(maxnreg=80, programs_per_sm=6),
}


def _variants(
    case: ic.PagedIndexerCase, ref: torch.Tensor, tol: torch.Tensor, key_bytes: int
) -> dict:
    """Score-stage µs, GB/s, error (x tol) and registers of each variant; failures reported."""
    dev = case.q.device
    base = it.chunk_for(case.q.shape[0], ref.shape[1], it.IndexerConfig().block_n, dev)
    chunks = {"chunk_x2": 2 * base, "chunk_half": max(it.IndexerConfig().block_n, base // 2)}
    out = {}
    for name, cfg in VARIANTS.items():
        chunk = chunks.get(name)

        def fn(cfg: it.IndexerConfig = cfg, chunk: int | None = chunk) -> torch.Tensor:
            return it.indexer_scores_paged_triton(
                *case.args(), case.softmax_scale, config=cfg, chunk=chunk
            )

        try:
            s = fn()
            compiled = it.last_compiled[0]
            us = _us(fn, rep=50)
            out[name] = {
                "scores_us": us,
                "GBps": key_bytes / (us * 1e3),
                "err_over_tol": _score_err(s, ref, tol),
                "regs": getattr(compiled, "n_regs", None),
                "spills": getattr(compiled, "n_spills", None),
            }
        except Exception as exc:  # a variant that does not compile is a result too
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of b's picks that a picks too (sets; ties may swap members)."""
    fr = []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        ys = {v for v in y if v >= 0}
        fr.append(len(ys & {v for v in x if v >= 0}) / max(1, len(ys)))
    return sum(fr) / len(fr)


def _print_tables(rows: list[dict], seconds: float, copy: float) -> None:
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{seconds:.1f} s; µs per decode step (one layer's indexer), "
        f"H={H} D={D} top_k={K}, all checked against the reference first; "
        f"HBM copy {copy:.0f} GB/s"
    )
    head = (
        f"{'mode':5} {'batch':>5} {'context':>7} {'reference':>10} {'triton':>8} "
        f"{'graph':>8} {'scores':>8} {'topk':>8} {'GB/s':>6} {'speedup':>7} {'overlap':>7}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['kind']:5} {r['batch']:>5} {r['context']:>7} {r['reference_us']:>10.0f} "
            f"{r['triton_us']:>8.1f} {r['graph_us']:>8.1f} {r['scores_us']:>8.1f} "
            f"{r['topk_us']:>8.1f} {r['score_GBps']:>6.0f} "
            f"{r['speedup_vs_reference']:>6.1f}x {r['set_overlap_vs_reference']:>7.4f}"
        )
    if any("maxima" in r for r in rows):
        print("\nscores + top-k in graphs, µs: the top-k's group maxima from the score kernel "
              "vs the stages apart")  # fmt: skip
        for r in rows:
            if "maxima" in r:
                m = r["maxima"]
                print(f"{r['batch']:>5} x {r['context']:>7}: handed over {m['handed_us']:7.1f}"
                      f"  apart {m['apart_us']:7.1f}")  # fmt: skip
    if any("before_scores_us" in r for r in rows):
        print(
            "\nscore stage, --baseline (before) vs default (now), µs / GB/s / % of copy, "
            "medians of three alternating rounds:"
        )
        for r in rows:
            if "before_scores_us" in r:
                print(
                    f"{r['kind']:5} {r['batch']:>5} {r['context']:>7} "
                    f"{r['before_scores_us']:>8.1f} {r['before_GBps']:>6.0f} "
                    f"{100 * r['before_GBps'] / copy:>5.0f}% {r['ab_scores_us']:>8.1f} "
                    f"{r['ab_GBps']:>6.0f} {100 * r['ab_GBps'] / copy:>5.0f}% "
                    f"{r['before_scores_us'] / r['ab_scores_us']:>6.2f}x "
                    f"(err before {r['before_err_over_tol']:.3f})"
                )
    print("\nscore stage, old config (OLD_FP8_CONFIG) vs new (default), µs / GB/s / % of copy:")
    print(
        f"{'mode':5} {'batch':>5} {'context':>7} {'old µs':>8} {'GB/s':>6} {'%copy':>6} "
        f"{'new µs':>8} {'GB/s':>6} {'%copy':>6} {'speedup':>7} {'err new':>7}"
    )
    for r in rows:
        print(
            f"{r['kind']:5} {r['batch']:>5} {r['context']:>7} {r['old_scores_us']:>8.1f} "
            f"{r['old_score_GBps']:>6.0f} {100 * r['old_score_GBps'] / copy:>5.0f}% "
            f"{r['scores_us']:>8.1f} {r['score_GBps']:>6.0f} "
            f"{100 * r['score_GBps'] / copy:>5.0f}% "
            f"{r['old_scores_us'] / r['scores_us']:>6.2f}x {r['score_err_over_tol']:>7.3f}"
        )
    if any("gluon" in r for r in rows):
        print(
            "\nscore stage, Triton kernel vs Gluon TMA kernel per ring depth (stages, programs "
            "per SM): µs a call in CUDA graphs / % of copy, medians of three alternating rounds; "
            "error x tol, max |gluon - triton|"
        )
        for r in rows:
            for n, g in r.get("gluon", {}).items():
                print(
                    f"{r['batch']:>5} {r['context']:>7} stages {n:>8} x{g['per_sm']} "
                    f"triton {g['triton_us']:>7.1f} {100 * g['triton_GBps'] / copy:>4.0f}%  "
                    f"gluon {g['gluon_us']:>7.1f} {100 * g['GBps'] / copy:>4.0f}%  "
                    f"{g['triton_us'] / g['gluon_us']:>5.2f}x  err {g['err_over_tol']:.3f}  "
                    f"diff {g['max_diff_vs_triton']:.2e} -inf equal {g['neginf_equal']} "
                    f"regs {g['regs']}"
                )
    names = list(VARIANTS)
    if not any("variants" in r for r in rows):
        return
    print("\nscore stage sweep, fp8 pages: GB/s (error x tol); default first")
    print(f"{'batch':>5} {'context':>7} {'default':>8} " + " ".join(f"{n:>15}" for n in names))
    for r in rows:
        if "variants" not in r:
            continue
        cells = []
        for n in names:
            v = r["variants"][n]
            cells.append(
                f"{v['GBps']:>6.0f} ({v['err_over_tol']:.2f})" if "error" not in v else "failed"
            )
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['score_GBps']:>8.0f} "
            + " ".join(f"{c:>15}" for c in cells)
        )
    last = [r for r in rows if "variants" in r][-1]["variants"]
    print("registers / spills:", {n: (v.get("regs"), v.get("spills")) for n, v in last.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 32K only")
    parser.add_argument("--no-sweep", action="store_true", help="skip the VARIANTS sweep")
    parser.add_argument("--baseline", help="a module file whose score stage runs beside")
    parser.add_argument("--cases", help="only these fp8 batch x context cases, e.g. 29x131072")
    parser.add_argument(
        "--gluon-stages",
        default="",
        help="time the Gluon kernel at ring depths[:programs per SM[:maxnreg]], e.g. 4,6:3:80",
    )
    parser.add_argument(
        "--maxima",
        action="store_true",
        help="time scores + top-k with the floor's group maxima handed over and apart",
    )
    args = parser.parse_args()
    stages = [tuple(int(x) for x in v.split(":")) for v in args.gluon_stages.split(",") if v]
    before = baseline_function(args.baseline, "indexer_scores_paged_triton")
    if not torch.cuda.is_available():
        print("bench_indexer needs CUDA", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [("fp8", b, c) for c in (32768, 131072) for b in (1, 8, 29, 64)]
    cases += [("exact", 8, 32768), ("exact", 8, 131072)]
    if args.quick:
        cases = [c for c in cases if c[2] == 32768 and c[1] <= 8]
    if args.cases:
        pick = {tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")}
        cases = [c for c in cases if c[0] == "fp8" and (c[1], c[2]) in pick]
    t0 = time.perf_counter()
    copy = copy_GBps()
    print(f"HBM copy: {copy:.0f} GB/s", flush=True)
    rows = []
    for i, (kind, batch, context) in enumerate(cases):
        row = run_case(
            kind, batch, context, seed=i, sweep=not args.no_sweep, before=before, stages=stages,
            maxima=args.maxima,
        )  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    _print_tables(rows, time.perf_counter() - t0, copy)
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bench_indexer.json"
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "copy_GBps": copy,
        }
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
