"""Lightning indexer per decode step: Triton score kernel + torch.topk against the reference.

DeepSeek-V3.2 sizes (64 heads x 128 dims, index_topk 2048, block size 64), one decode token per
request, every request at the same context; batch 1 / 8 / 64 at 32K and 128K tokens. For each
case it first checks the kernel against the reference (`indexer_triton.selection_errors`,
tolerance as in tests/gpu/test_indexer_gpu.py; it stops at the first failure), then times:

- ``reference``: `indexer_topk_paged_reference` (the model's path before the kernel);
- ``triton``: `indexer_topk_paged_triton`, eager (score kernel, then torch.topk);
- ``graph``: the same captured in one CUDA graph (what a graph-captured decode step pays);
- ``scores`` / ``topk``: the two stages alone (eager).

Times are medians of `triton.testing.do_bench` (which flushes L2 between runs), in µs.
``GB/s`` is the score stage's key bytes (``contexts x 132 B``) over its time. Exact mode
(fp32 keys) runs at batch 8 only. Writes ``$OUT/bench_indexer.json`` when ``OUT`` is set.

    PYTHONPATH=src python3 benchmarks/bench_indexer.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton.testing

from hisparse.attention import indexer_triton as it
from hisparse.attention.indexer_reference import indexer_topk_paged_reference

H, D, K, BS = 64, 128, 2048, 64
RTOL, ATOL = 1e-4, 1e-6
DEVICE = "cuda"


def _us(fn, rep: int = 100) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _graph_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _us(graph.replay)


def run_case(kind: str, batch: int, context: int, seed: int) -> dict:
    dev = torch.device(DEVICE)
    case = it.random_indexer_case(
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

    def scores() -> torch.Tensor:
        return it.indexer_scores_paged_triton(*args, case.softmax_scale)

    def reference() -> torch.Tensor:
        return indexer_topk_paged_reference(*args, case.seq_lens, K, case.softmax_scale)

    # Correctness first.
    got = triton_topk()
    s = scores()
    ref = it.reference_scores(case, s.shape[1])
    tol = it.score_tolerance(ref, RTOL, ATOL)
    finite = torch.isfinite(ref)
    err = float(((s - ref).abs().masked_fill(~finite, 0) / tol).max())
    errors = it.selection_errors(got, ref, case.limits, K, tol)
    if err > 1.0 or errors:
        raise SystemExit(
            f"{kind} batch {batch} ctx {context}: score error {err:.3g} x tol, {errors}"
        )
    want = reference()
    overlap = _overlap(got, want)

    sc = s.clone()
    row = {
        "kind": kind,
        "batch": batch,
        "context": context,
        "score_err_over_tol": err,
        "set_overlap_vs_reference": overlap,
        "reference_us": _us(reference, rep=200),
        "triton_us": _us(triton_topk),
        "graph_us": _graph_us(triton_topk),
        "scores_us": _us(scores),
        "topk_us": _us(lambda: it.topk_from_scores(sc, K)),
        "chunk": it.chunk_for(batch, context, it.default_config(case.fmt.kind).block_n, dev),
    }
    row["score_GBps"] = batch * context * case.fmt.row_bytes / (row["scores_us"] * 1e3)
    row["speedup_vs_reference"] = row["reference_us"] / row["triton_us"]
    compiled = it.last_compiled[0]  # the default config's kernel (timed last above)
    if compiled is not None and hasattr(compiled, "n_regs"):
        row["regs"], row["spills"] = compiled.n_regs, compiled.n_spills
    if kind == "fp8":
        row["variants"] = _variants(case, ref_tol=(ref, tol))
    return row


#: Score-kernel tile shapes tried besides the default (the table's last columns).
VARIANTS = {
    "bn128w8": it.IndexerConfig(block_n=128, num_warps=8),
    "bn32w4": it.IndexerConfig(block_n=32, num_warps=4),
    "stages2": it.IndexerConfig(num_stages=2),
    "fp8dot": it.IndexerConfig(fp8_dot=True),
}


def _variants(case: it.PagedIndexerCase, ref_tol: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Score-stage µs and error (x tol) of each variant; a failure is reported, not raised."""
    ref, tol = ref_tol
    out = {}
    for name, cfg in VARIANTS.items():

        def fn(cfg: it.IndexerConfig = cfg) -> torch.Tensor:
            return it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, config=cfg)

        try:
            s = fn()
            err = float(((s - ref).abs().masked_fill(~torch.isfinite(ref), 0) / tol).max())
            out[name] = {"scores_us": _us(fn), "err_over_tol": err}
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


def _print_tables(rows: list[dict], seconds: float) -> None:
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{seconds:.1f} s; µs per decode step (one layer's indexer), "
        f"H={H} D={D} top_k={K}, all checked against the reference first"
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
    print("\nscore stage only, µs (error x tol) of the tile variants, fp8 pages:")
    names = list(VARIANTS)
    print(f"{'batch':>5} {'context':>7} {'default':>8} " + " ".join(f"{n:>16}" for n in names))
    for r in rows:
        if "variants" not in r:
            continue
        cells = []
        for n in names:
            v = r["variants"][n]
            cells.append(
                f"{v['scores_us']:>8.1f} ({v['err_over_tol']:.2f})"
                if "error" not in v
                else "failed"
            )
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['scores_us']:>8.1f} "
            + " ".join(f"{c:>16}" for c in cells)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 32K only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_indexer needs CUDA", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [("fp8", b, c) for c in (32768, 131072) for b in (1, 8, 64)]
    cases += [("exact", 8, 32768), ("exact", 8, 131072)]
    if args.quick:
        cases = [c for c in cases if c[2] == 32768 and c[1] <= 8]
    t0 = time.perf_counter()
    rows = []
    for i, (kind, batch, context) in enumerate(cases):
        row = run_case(kind, batch, context, seed=i)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    _print_tables(rows, time.perf_counter() - t0)
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bench_indexer.json"
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
