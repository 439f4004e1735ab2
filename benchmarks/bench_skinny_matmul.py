"""The decode step's projections at a few rows: cuBLAS (``F.linear``) beside the skinny
Triton kernel (`hisparse.models.skinny_matmul_triton`), against the HBM copy rate.

Each case checks the kernel against an fp32 ``F.linear`` first (max error relative to the
output's largest value), then times both as ten calls captured in one CUDA graph, cycling
through enough copies of the weight (at least 256 MB) that the 50 MB L2 cannot serve a repeat.
``--sweep`` also times a grid of kernel configs and prints the best per case.

    PYTHONPATH=src python3 benchmarks/bench_skinny_matmul.py --rows 1,8,29 [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from hisparse.models.skinny_matmul_triton import num_sms, pick_config, skinny_linear
from hisparse.testing.cuda_graphs import graph_call_us

#: (name, out features, in features): DeepSeek-V3.2's attention projections (the stacked
#: a/b projections as the model runs them) and its shared expert and dense MLP
SHAPES = [
    ("a_proj (q_a, kv_a, wk)", 2240, 7168),
    ("b_proj (q_b, wq_b)", 32768, 1536),
    ("o_proj", 7168, 16384),
    ("dense gate_up", 36864, 7168),
    ("dense down", 7168, 18432),
    ("shared gate_up", 4096, 7168),
    ("shared down", 7168, 2048),
    ("small gate_up (bench preset)", 2048, 7168),
]


def copy_gbps() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() / ms / 1e6


def timed(fn, weights, x) -> float:
    """µs a call, cycling through ``weights`` (10 calls a graph replay)."""
    it = itertools.cycle(weights)
    calls = [next(it) for _ in range(10)]
    i = iter(range(10**9))

    def one():
        return fn(x, calls[next(i) % len(calls)])

    return graph_call_us(one, calls=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,29")
    ap.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    dev = torch.device("cuda")
    sms = num_sms(dev)
    gbps = copy_gbps()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    sweep = [
        (bn, bk, st, w, f)
        for bn, bk, st, w in [
            (64, 128, 4, 4), (64, 128, 6, 4), (64, 256, 3, 4), (64, 256, 4, 4),
            (128, 128, 3, 4), (128, 128, 4, 8), (128, 64, 6, 4), (32, 256, 4, 4),
        ]
        for f in (0.5, 1.0, 2.0)
    ]  # fmt: skip
    for name, n, k in shapes:
        wbytes = n * k * 2
        copies = max(1, -(-(256 << 20) // wbytes))
        weights = [
            torch.randn((n, k), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
            for _ in range(copies)
        ]
        for m in rows:
            x = torch.randn((m, k), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            scale = ref.abs().max().item()
            err = (skinny_linear(x, weights[0]).float() - ref).abs().max().item() / scale
            err_cublas = (F.linear(x, weights[0]).float() - ref).abs().max().item() / scale
            assert err < 2e-2, (name, m, err)
            ideal = wbytes / gbps / 1e3
            cub = timed(F.linear, weights, x)
            ours = timed(skinny_linear, weights, x)
            cfg = pick_config(m, n, k, sms)
            row = dict(
                shape=name, n=n, k=k, rows=m, weight_mb=wbytes / 1e6, copy_us=ideal,
                cublas_us=cub, skinny_us=ours, config=cfg, err=err, err_cublas=err_cublas,
            )  # fmt: skip
            if args.sweep:
                best = None
                for bn, bk, st, w, f in sweep:
                    bm = 16 if m <= 16 else 32
                    base = pick_config(m, n, k, sms)[3]
                    splits = max(1, round(base * f))
                    c = (bm, bn, bk, splits, st, w)
                    try:
                        us = timed(lambda a, b, c=c: skinny_linear(a, b, c), weights, x)
                    except Exception as e:  # a config that does not compile or fit
                        print(f"  {c}: {type(e).__name__}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, c)
                row["best_us"], row["best_config"] = best
            results.append(row)
            print(json.dumps(row), flush=True)
        del weights
    (out_dir / "bench_skinny_matmul.json").write_text(
        json.dumps(dict(copy_gbps=gbps, results=results), indent=1)
    )
    print(f"\nHBM copy {gbps:.0f} GB/s; µs a call (% of the copy rate)")
    head = "| shape | rows | MB | copy µs | cuBLAS µs | skinny µs | cuBLAS / skinny |"
    if args.sweep:
        head += " best swept µs | config |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        pct = lambda us, r=r: f"{us:.1f} ({100 * r['copy_us'] / us:.0f}%)"  # noqa: E731
        line = (
            f"| {r['shape']} | {r['rows']} | {r['weight_mb']:.0f} | {r['copy_us']:.1f} | "
            f"{pct(r['cublas_us'])} | {pct(r['skinny_us'])} | "
            f"{r['cublas_us'] / r['skinny_us']:.2f} |"
        )
        if args.sweep:
            line += f" {pct(r['best_us'])} | {r['best_config']} |"
        print(line)
    med = statistics.median(r["cublas_us"] / r["skinny_us"] for r in results)
    print(f"median cuBLAS / skinny: {med:.2f}")


if __name__ == "__main__":
    main()
