"""Block-fp8 GEMMs on DeepSeek-V3.2's real shapes against cuBLAS bf16, checked and timed in one run.

For each projection (attention's q_a / q_b / kv_a / o, the indexer's wq_b / wk, an expert's
gate / up / down) and 1, 29, 256 and 8,192 tokens: ``torch._scaled_mm`` blockwise and the
Triton kernel (each with its activation quantization, as `fp8_linear.fp8_gemm` runs them)
against ``x @ W.T`` in bf16, each checked against the W8A8 reference (`fp8.w8a8_linear`)
first. Then the routed experts (256 experts, 8 a token) through the grouped Triton GEMMs
(`Fp8Experts.forward_grouped`) against bf16 GEMMs per expert, checked against
`Fp8Experts.forward_reference`. TFLOP/s count 2·M·N·K; "of bf16" is the time ratio at the same
shape, and "of peak" the rate over a large bf16 matmul's rate measured in the same run.

    python benchmarks/bench_fp8_gemm.py [--json out.json] [--tokens 1,29,256,8192]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

#: DeepSeek-V3.2's projections, (N, K) of ``W [N, K]``.
SHAPES: dict[str, tuple[int, int]] = {
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "o": (7168, 16384),
    "idx_wq_b": (8192, 1536),
    "idx_wk": (128, 7168),
    "expert_gate_up": (2048, 7168),
    "expert_down": (7168, 2048),
}
EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 7168, 2048


DEV = torch.device("cuda")


def bench(fn) -> float:
    """Median milliseconds (CUDA events, `triton.testing.do_bench`; a few host-timed calls on
    the CPU, where ``--small`` only checks that the script runs)."""
    if DEV.type != "cuda":
        import statistics
        import time

        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def triton_gemm(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    from hisparse.models import fp8_triton

    qx, sx = fp8_triton.act_quant(x)
    return fp8_triton.block_gemm(qx, sx, qw, sw, out_dtype=x.dtype)


def scaled_mm_gemm(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    from hisparse.models import fp8_linear, fp8_triton

    qx, sx = fp8_triton.act_quant(x)
    return fp8_linear._scaled_mm(qx, sx, qw, sw, x.dtype)


def bf16_experts(x, wts, groups, w_gu, w_d) -> torch.Tensor:
    """The routed experts in bf16, one cuBLAS GEMM pair per expert with tokens."""
    m = x.shape[0]
    y = torch.empty(m * TOP_K, HIDDEN, device=x.device, dtype=torch.bfloat16)
    for e, pairs in groups:
        gu = x[pairs // TOP_K] @ w_gu[e].t()
        h = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
        y[pairs] = h @ w_d[e].t()
    return (y.view(m, TOP_K, -1).float() * wts.unsqueeze(-1)).sum(1).to(x.dtype)


def peak_rate(side: int) -> float:
    """TFLOP/s of a ``side``-cubed bf16 matmul."""
    a = torch.randn(side, side, device=DEV, dtype=torch.bfloat16)
    return 2 * side**3 / bench(partial(torch.matmul, a, a)) / 1e9


def linear_rows(tokens: list[int], peak: float) -> list[dict]:
    from hisparse.models import fp8, fp8_linear

    dev = DEV
    use_mm = dev.type == "cuda" and fp8_linear.scaled_mm_ok(dev)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        qw, sw = fp8.quantize_weight(w)
        for m in tokens:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = fp8.w8a8_linear(x, qw, sw)
            variants = {
                "bf16 cuBLAS": partial(torch.matmul, x, w.t()),
                "fp8 Triton": partial(triton_gemm, x, qw, sw),
            }
            if use_mm and fp8_linear._scaled_mm_shape(qw, 0):
                variants["fp8 scaled_mm"] = partial(scaled_mm_gemm, x, qw, sw)
            flops = 2 * m * n * k
            t_bf16 = None
            for label, fn in variants.items():
                err = rel_err(fn(), ref)
                if label != "bf16 cuBLAS" and err > 2e-2:
                    raise AssertionError(f"{name} M={m} {label}: rel err {err:.3g} vs W8A8")
                ms = bench(fn)
                t_bf16 = ms if label == "bf16 cuBLAS" else t_bf16
                rows.append(dict(shape=name, n=n, k=k, m=m, variant=label, ms=ms, err=err,
                                 tflops=flops / ms / 1e9, of_bf16=t_bf16 / ms,
                                 of_peak=flops / ms / 1e9 / peak))  # fmt: skip
    return rows


def moe_rows(tokens: list[int], peak: float) -> list[dict]:
    from hisparse.models import fp8
    from hisparse.models.fp8_moe import Fp8Experts

    dev = DEV
    torch.manual_seed(0)
    with torch.device(dev):
        ex = Fp8Experts(EXPERTS, HIDDEN, INTER)
    w_gu = torch.empty(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    w_d = torch.empty(EXPERTS, HIDDEN, INTER, device=dev, dtype=torch.bfloat16)
    for e in range(EXPERTS):  # per expert: the bf16 copies and the fp8 tiles of the same values
        g = torch.randn(2 * INTER, HIDDEN, device=dev) / HIDDEN**0.5
        d = torch.randn(HIDDEN, INTER, device=dev) / INTER**0.5
        w_gu[e], w_d[e] = g, d
        qg, sg = fp8.quantize_weight(g[:INTER])
        qu, su = fp8.quantize_weight(g[INTER:])
        qd, sd = fp8.quantize_weight(d)
        ex.gate_weight.data[e], ex.gate_scale.data[e] = qg, sg
        ex.up_weight.data[e], ex.up_scale.data[e] = qu, su
        ex.down_weight.data[e], ex.down_scale.data[e] = qd, sd
    rows = []
    for m in tokens:
        x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in range(m)])
        wts = torch.softmax(torch.randn(m, TOP_K, device=dev), -1)
        flat = ids.reshape(-1)
        used = flat.unique().tolist()
        groups = [(e, (flat == e).nonzero().squeeze(1)) for e in used]

        bf16 = partial(bf16_experts, x, wts, groups, w_gu, w_d)
        fp8_grouped = partial(ex.forward_grouped, x, wts, ids)
        if m <= 256:
            err = rel_err(fp8_grouped(), ex.forward_reference(x, wts, ids))
            if err > 2e-2:
                raise AssertionError(f"experts M={m}: grouped rel err {err:.3g} vs reference")
        else:
            err = rel_err(fp8_grouped(), bf16())
        flops = 2 * m * TOP_K * 3 * INTER * HIDDEN
        t_bf16 = bench(bf16)
        t_fp8 = bench(fp8_grouped)
        for label, ms in (("bf16 cuBLAS per expert", t_bf16), ("fp8 Triton grouped", t_fp8)):
            rows.append(dict(shape=f"experts ({len(used)} used)", n=INTER, k=HIDDEN, m=m,
                             variant=label, ms=ms, err=err if "fp8" in label else 0.0,
                             tflops=flops / ms / 1e9, of_bf16=t_bf16 / ms,
                             of_peak=flops / ms / 1e9 / peak))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,29,256,8192")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-moe", action="store_true")
    p.add_argument(
        "--small", action="store_true", help="a CPU check of the script: small shapes, no timing"
    )
    args = p.parse_args()
    global DEV, SHAPES, EXPERTS, HIDDEN, INTER
    if args.small:
        DEV = torch.device("cpu")
        SHAPES = {"q_a": (256, 384), "kv_a": (192, 256)}
        EXPERTS, HIDDEN, INTER = 8, 256, 128
        args.tokens = "1,29"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm needs a CUDA GPU (--small checks the script on the CPU)")
    tokens = [int(t) for t in args.tokens.split(",")]
    side = 8192 if DEV.type == "cuda" else 256
    peak = peak_rate(side)
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"bf16 matmul {side}^3: {peak:.1f} TFLOP/s ({name})", flush=True)
    rows = linear_rows(tokens, peak)
    if not args.no_moe:
        rows += moe_rows(tokens, peak)
    if args.json:
        args.json.write_text(json.dumps(dict(peak_tflops=peak, rows=rows), indent=2))
    print("| shape | M | variant | µs | TFLOP/s | × bf16 speed | of bf16 peak | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | {r['variant']} | "
              f"{1e3 * r['ms']:.1f} | {r['tflops']:.1f} | {r['of_bf16']:.2f} | "
              f"{r['of_peak']:.0%} | {r['err']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
