"""GQA decode indexer per layer: the fused Triton kernels against the torch path, in CUDA graphs.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head dim 64, block size 64), ``fp8`` keys,
top_k 256, 4 sinks, a 64-token window, bf16 queries (the model's dtype on CUDA), one decode
token per request, every request at the same context: batch 1 and 64 at 556, 2048 and 8192
keys, plus the CUDA-graph bound (``longest`` = 8192, the table's capacity, with 556-key
requests: what the engine's captured decode step passes).

Each path is captured in one CUDA graph of ``LAYERS`` calls, each over its own page pool and
queries (as the 30 layers of a decode step: keys do not stay in L2 from one call to the next);
the time is the median of `triton.testing.do_bench` over replays, divided by ``LAYERS``: µs per
layer and step. Before timing, each case checks the kernel against the torch path
(`gqa_indexer_cases.selection_errors`, tolerance of tests/gpu/test_gqa_indexer_gpu.py) and
prints the agreement (share of the torch path's picks the kernel also picks; below 1 only by
near-ties at the k-th mass). A sweep of tile configs follows on three cases. Writes
``$OUT/bench_gqa_indexer.json`` when ``OUT`` is set; the short table comes last.

    PYTHONPATH=src python3 benchmarks/bench_gqa_indexer.py [--quick] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton.testing

from hisparse.attention import dispatch
from hisparse.attention import gqa_indexer_reference as gr
from hisparse.attention import gqa_indexer_triton as git
from hisparse.testing import gqa_indexer_cases as gcases
from hisparse.testing.cuda_graphs import graph_call_us

H, G, D, BS, TOP_K = 9, 3, 64, 64, 256
CFG = gr.GqaIndexerConfig(top_k=TOP_K, sink_tokens=4, recent_window=64)
SCALE = D**-0.5
RTOL, ATOL = 1e-4, 1e-6
LAYERS = 8
#: (batch, context, capacity or None)
CASES = [(1, 556, None), (64, 556, None), (1, 2048, None), (64, 2048, None), (1, 8192, None),
         (64, 8192, None), (1, 556, 8192), (64, 556, 8192)]  # fmt: skip
SWEEP_CASES = [(64, 556, 8192), (1, 8192, None), (64, 8192, None)]
VARIANTS = {
    "chunk64": git.GqaIndexerTritonConfig(chunk=64),
    "chunk128": git.GqaIndexerTritonConfig(chunk=128),
    "chunk256": git.GqaIndexerTritonConfig(chunk=256),
    "chunk512": git.GqaIndexerTritonConfig(chunk=512),
    "sel_w4": git.GqaIndexerTritonConfig(warps_select=4),
    "bs2048": git.GqaIndexerTritonConfig(block_s=2048),
    "bn32": git.GqaIndexerTritonConfig(block_n=32, chunk=128),
    "logit_w8": git.GqaIndexerTritonConfig(warps_logits=8, block_n=128, chunk=256),
}


def _cases(batch: int, context: int, capacity: int | None, seed: int) -> list[gcases.DecodeCase]:
    return [
        gcases.random_decode_case(
            [context] * batch,
            heads=H,
            kv_heads=G,
            head_dim=D,
            block_size=BS,
            capacity=capacity,
            key_scale=3.0,
            q_dtype=torch.bfloat16,
            seed=seed + i,
            device="cuda",
        )
        for i in range(LAYERS)
    ]


def _torch_path(case: gcases.DecodeCase) -> torch.Tensor:
    os.environ["HISPARSE_GQA_INDEXER"] = "reference"
    try:
        return dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)
    finally:
        del os.environ["HISPARSE_GQA_INDEXER"]


def _graph_us(calls) -> float:
    """µs per call: one graph of every call, replay median over ``len(calls)``."""

    def all_calls() -> None:
        for fn in calls:
            fn()

    return graph_call_us(all_calls, calls=1) / len(calls)


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of the torch path's picks (scored rows) that the kernel picks too."""
    both = total = 0
    for g, w in zip(got.cpu().tolist(), want.cpu().tolist(), strict=True):
        ws = {x for x in w if x >= 0}
        both += len(ws & {x for x in g if x >= 0})
        total += len(ws)
    return both / max(total, 1)


def run_case(batch: int, context: int, capacity: int | None, seed: int) -> dict:
    cases = _cases(batch, context, capacity, seed)
    c0 = cases[0]
    got = git.gqa_indexer_topk_decode_triton(*c0.args(), CFG, SCALE, TOP_K)
    want = _torch_path(c0)
    ref = gcases.reference_scores(c0, CFG, SCALE)
    errors = gcases.selection_errors(got, want, c0, CFG, ref, RTOL, ATOL)
    row = {
        "batch": batch, "context": context, "longest": c0.longest,
        "agreement": _agreement(got, want), "errors": errors[:3],
        "torch_us": _graph_us([lambda c=c: _torch_path(c) for c in cases]),
        "triton_us": _graph_us([
            lambda c=c: git.gqa_indexer_topk_decode_triton(*c.args(), CFG, SCALE, TOP_K)
            for c in cases
        ]),
    }  # fmt: skip
    row["speedup"] = row["torch_us"] / row["triton_us"]
    return row


def sweep(batch: int, context: int, capacity: int | None, seed: int, deadline: float) -> dict:
    cases = _cases(batch, context, capacity, seed)
    out = {"batch": batch, "context": context, "longest": cases[0].longest}
    want = _torch_path(cases[0])
    ref = gcases.reference_scores(cases[0], CFG, SCALE)
    for name, cfg in VARIANTS.items():
        if time.time() > deadline:
            out[name] = "skipped (budget)"
            continue
        got = git.gqa_indexer_topk_decode_triton(*cases[0].args(), CFG, SCALE, TOP_K, config=cfg)
        bad = gcases.selection_errors(got, want, cases[0], CFG, ref, RTOL, ATOL)
        us = _graph_us([
            lambda c=c, k=cfg: git.gqa_indexer_topk_decode_triton(
                *c.args(), CFG, SCALE, TOP_K, config=k
            )
            for c in cases
        ])  # fmt: skip
        out[name] = round(us, 2) if not bad else f"{us:.2f} ERR {bad[0]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 64 cases only")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=110.0, help="skip the rest past this")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "layers_per_graph": LAYERS, "top_k": TOP_K}  # fmt: skip
    rows, sweeps = [], []
    out_dir = os.environ.get("OUT")

    def save() -> None:
        if out_dir:
            path = Path(out_dir) / "bench_gqa_indexer.json"
            path.write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweeps}, indent=1))

    for i, (b, ctx, cap) in enumerate(CASES):
        if args.quick and b != 64:
            continue
        if time.time() - start > args.budget_s:
            print(f"budget spent: skipping {b}x{ctx}", flush=True)
            continue
        row = run_case(b, ctx, cap, seed=100 * i)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
        torch.cuda.empty_cache()
    if not args.no_sweep:
        for i, (b, ctx, cap) in enumerate(SWEEP_CASES):
            if time.time() - start > args.budget_s:
                print(f"budget spent: skipping the sweep of {b}x{ctx}", flush=True)
                continue
            s = sweep(b, ctx, cap, 7000 + i, start + args.budget_s)
            sweeps.append(s)
            print("sweep", json.dumps(s), flush=True)
            save()
            torch.cuda.empty_cache()
    print(f"\nGQA decode indexer, µs per layer in CUDA graphs ({meta['device']}):")
    print(f"{'batch':>5} {'context':>7} {'longest':>7} {'torch':>8} {'triton':>8} {'speedup':>7}"
          f" {'agree':>7} {'errors':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['longest']:>7} {r['torch_us']:>8.1f} "
            f"{r['triton_us']:>8.1f} {r['speedup']:>6.1f}x {r['agreement']:>7.4f} "
            f"{len(r['errors']):>6}"
        )
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
