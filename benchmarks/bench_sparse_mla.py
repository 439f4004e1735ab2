"""Sparse MLA decode on the GPU: the Triton kernel vs the same run's HBM copy and the reference.

Run on the GPU machine: ``PYTHONPATH=src python benchmarks/bench_sparse_mla.py``.

For fp8_ds_mla (656 B) and bf16 (1152 B) rows, batch (tokens) 1, 64 and 256, top_k 2048,
128 heads, bf16 queries: the median µs of one call for each tile shape in ``CONFIGS`` (the
best is reported), timed as CUDA-graph replays (as a decode step runs; a graph holds one
call per index set and enough sets to move >= 256 MB, so L2 cannot serve repeats; the eager
``do_bench`` time of the best shape, launch overhead included, is reported too); achieved
GB/s over the fewest bytes a call must move (gathered rows + q + out, `decode_bytes`)
against the HBM device-to-device copy bandwidth measured in this run (bytes read +
written); the matrix TFLOP/s (`decode_flops`); and the plain PyTorch gather + attention
(`sparse_mla_decode_reference` on the GPU, fp32). Rows come from a fresh pool of a few GiB
(far above the 60 MB L2) at uniformly random indices. Every tile shape is checked against
the reference in the same run (max abs error and relative Frobenius error) and reports its
registers and spills.

``--splits 1,2,4,...`` times instead, for fp8_ds_mla rows and the default shape, the call
(kernel and combine) at each of those split counts per batch, beside `num_splits_for`'s
choice: the data its cost model is fitted to. With ``--baseline FILE`` (another version's
module file, e.g. ``git show REV:src/hisparse/attention/sparse_mla_triton.py``) it also times
that version's call and this one at the model's split count, alternating, per batch.

Prints a table last and writes JSON to ``$OUT/bench_sparse_mla.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import triton

from bench_indexer import baseline_function  # (this script's folder is on sys.path)
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference
from hisparse.kv.row_formats import mla_row_bytes, pack_mla_rows

DEV = torch.device("cuda")
H, K, C, R, BS = 128, 2048, 512, 64, 64
SCALE = 192**-0.5
GRAPH_BYTES = 256e6
#: ``--sweep`` times all of these; without it only the default shape runs.
CONFIGS = [
    smt.DecodeConfig(64, 64, 8, 2),
    smt.DecodeConfig(64, 64, 8, 1),
    smt.DecodeConfig(64, 32, 8, 2),
    smt.DecodeConfig(16, 32, 4, 2),
]
PREFILL_TOKENS = 2048


def _label(cfg: smt.DecodeConfig) -> str:
    return f"{cfg.block_h},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"


def _warm_one(job: tuple[str, dict]) -> str:
    """Compile one (format, shape) in a worker process: Triton's on-disk cache is shared, so
    the timed process only loads it (16 CPU cores compile the sweep in parallel)."""
    fmt, cfg_dict = job
    cfg = smt.DecodeConfig(**cfg_dict)
    rb = mla_row_bytes(fmt, C, R)
    pool = torch.zeros(8, BS, rb, dtype=torch.uint8, device=DEV)
    idx = torch.zeros(2, K, dtype=torch.int32, device=DEV)
    ql = torch.zeros(2, H, C, device=DEV).bfloat16()
    qr = torch.zeros(2, H, R, device=DEV).bfloat16()
    t0 = time.time()
    try:
        for splits in (1, 2):  # bf16 output / fp32 partials + combine
            smt.sparse_mla_decode_triton(
                ql, qr, pool, idx, SCALE, fmt, config=cfg, num_splits=splits
            )
        torch.cuda.synchronize()
        return f"{fmt} {_label(cfg)} compiled in {time.time() - t0:.1f} s"
    except Exception as exc:  # reported again, with the error, in the timed run
        return f"{fmt} {_label(cfg)} failed: {type(exc).__name__}: {str(exc)[:120]}"


def precompile(configs: list[smt.DecodeConfig], workers: int = 12) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = [(f, c.__dict__) for f in ("fp8_ds_mla", "bf16") for c in configs]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for line in ex.map(_warm_one, jobs):
            print("  ", line, flush=True)
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.1f} s", flush=True)


def matmul_tflops(n: int = 8192) -> float:
    """bf16 matrix-product rate on random data (the tensor-core ceiling of this run)."""
    a = torch.randn(n, n, device=DEV).bfloat16()
    b = torch.randn(n, n, device=DEV).bfloat16()
    return 2 * n**3 / _median_us(lambda: a @ b) / 1e6


def _median_us(fn, rep_ms: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def graph_us(fn, sets: list[torch.Tensor], reps: int = 15) -> float:
    """Median µs per call of ``fn(idx)`` over CUDA-graph replays of one call per set."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for idx in sets:
            fn(idx)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for idx in sets:
            fn(idx)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(sets))
    del graph
    return statistics.median(times)


def hbm_copy_gbs(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth (bytes read + written)."""
    n = int(gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src))
    return 2 * n / us / 1e3


def make_pool(fmt: str, gib: float) -> torch.Tensor:
    """A ``[NB, 64, row_bytes]`` pool of random rows packed by `pack_mla_rows`."""
    rb = mla_row_bytes(fmt, C, R)
    nb = int(gib * (1 << 30)) // (rb * BS)
    pool = torch.empty(nb, BS, rb, dtype=torch.uint8, device=DEV)
    flat = pool.view(nb * BS, rb)
    step = 1 << 18
    g = torch.Generator(device=DEV).manual_seed(1)
    for lo in range(0, nb * BS, step):
        hi = min(nb * BS, lo + step)
        lat = torch.randn(hi - lo, C, generator=g, device=DEV)
        rope = torch.randn(hi - lo, R, generator=g, device=DEV)
        flat[lo:hi] = pack_mla_rows(fmt, lat, rope)
    return pool


def bench_case(
    fmt: str, pool: torch.Tensor, t: int, copy_gbs: float, configs: list, with_ref: bool = True
) -> dict:
    g = torch.Generator(device=DEV).manual_seed(100 + t)
    rows = pool.shape[0] * pool.shape[1]
    n_sets = min(128, max(4, math.ceil(GRAPH_BYTES / smt.decode_bytes(t, H, K, fmt))))
    sets = [
        torch.randint(0, rows, (t, K), generator=g, device=DEV, dtype=torch.int32)
        for _ in range(n_sets)
    ]
    ql = torch.randn(t, H, C, generator=g, device=DEV).bfloat16()
    qr = torch.randn(t, H, R, generator=g, device=DEV).bfloat16()
    # The oracle in fp32 on the GPU; past 256 tokens only the first 256 are checked.
    n_chk = min(t, 256)
    ref_o, ref_l = sparse_mla_decode_reference(
        ql[:n_chk], qr[:n_chk], pool, sets[0][:n_chk], SCALE, fmt
    )
    nbytes = smt.decode_bytes(t, H, K, fmt)
    flops = smt.decode_flops(t, H, K)
    counter = [0]

    def rotating(fn):
        def call() -> None:
            counter[0] += 1
            fn(sets[counter[0] % n_sets])

        return call

    ref_us = (
        _median_us(
            rotating(lambda idx: sparse_mla_decode_reference(ql, qr, pool, idx, SCALE, fmt)),
            rep_ms=60,
        )
        if with_ref
        else float("nan")
    )
    per_config = []
    for cfg in configs:
        entry: dict = {
            "config": cfg.__dict__, "label": _label(cfg),
            "splits": smt.num_splits_for(t, H, K, cfg, DEV),
        }  # fmt: skip
        try:
            out, lse = smt.sparse_mla_decode_triton(ql, qr, pool, sets[0], SCALE, fmt, config=cfg)
            torch.cuda.synchronize()
            out, lse = out[:n_chk], lse[:n_chk]
            err = (out.float() - ref_o.float()).abs().max().item()
            rel = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            lse_err = (lse - ref_l).abs().max().item()
            ck = smt.last_compiled[0]
            entry.update(n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None))
            us = graph_us(
                lambda idx, cfg=cfg: smt.sparse_mla_decode_triton(
                    ql, qr, pool, idx, SCALE, fmt, config=cfg
                ),
                sets,
            )
            entry.update(
                us=us, gbs=nbytes / us / 1e3, tflops=flops / us / 1e6, max_abs_err=err,
                rel_err=rel, lse_err=lse_err,
                ok=bool(err <= 1e-3 + 1.6e-2 * ref_o.float().abs().max().item() and rel < 1e-2),
                pct_copy=nbytes / us / 1e3 / copy_gbs * 100,
            )  # fmt: skip
        except Exception as exc:  # a tile shape that does not compile or fit is reported
            entry.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
        print(fmt, t, {k: (round(v, 5) if isinstance(v, float) else v)
                       for k, v in entry.items() if k != "config"}, flush=True)  # fmt: skip
        per_config.append(entry)
    good = [e for e in per_config if e.get("ok")]
    best = min(good, key=lambda e: e["us"]) if good else None
    default = next(
        (e for e in per_config if e["config"] == smt.default_config(t, H).__dict__), None
    )
    if best is not None and with_ref:
        bcfg = smt.DecodeConfig(**best["config"])
        best["eager_us"] = _median_us(
            rotating(
                lambda idx: smt.sparse_mla_decode_triton(ql, qr, pool, idx, SCALE, fmt, config=bcfg)
            )
        )
    return {
        "fmt": fmt, "tokens": t, "bytes": nbytes, "flops": flops, "ref_us": ref_us,
        "ref_gbs": nbytes / ref_us / 1e3, "best": best, "default": default, "configs": per_config,
        "pct_hbm": (best["gbs"] / copy_gbs * 100) if best else None,
    }  # fmt: skip


def split_sweep(
    pool: torch.Tensor, batches: list[int], splits: list[int], before=None
) -> list[dict]:
    """µs of one call (CUDA-graph replays, fresh index sets) per batch and split count; with
    ``before`` (another version's ``sparse_mla_decode_triton``) also that version and this
    one at the model's split count, in three alternating rounds (medians)."""
    cfg = smt.default_config(1, H)
    rows = []
    for t in batches:
        g = torch.Generator(device=DEV).manual_seed(200 + t)
        n_rows = pool.shape[0] * pool.shape[1]
        n_sets = min(128, max(4, math.ceil(GRAPH_BYTES / smt.decode_bytes(t, H, K, "fp8_ds_mla"))))
        sets = [torch.randint(0, n_rows, (t, K), generator=g, device=DEV, dtype=torch.int32)
                for _ in range(n_sets)]  # fmt: skip
        ql = torch.randn(t, H, C, generator=g, device=DEV).bfloat16()
        qr = torch.randn(t, H, R, generator=g, device=DEV).bfloat16()
        want = smt.sparse_mla_decode_triton(ql, qr, pool, sets[0], SCALE, "fp8_ds_mla", config=cfg)
        row = {"tokens": t, "model_splits": smt.num_splits_for(t, H, K, cfg, DEV), "us": {}}
        for n in splits:
            got = smt.sparse_mla_decode_triton(
                ql, qr, pool, sets[0], SCALE, "fp8_ds_mla", config=cfg, num_splits=n
            )
            torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
            row["us"][n] = graph_us(
                lambda idx, n=n, ql=ql, qr=qr: smt.sparse_mla_decode_triton(
                    ql, qr, pool, idx, SCALE, "fp8_ds_mla", config=cfg, num_splits=n
                ),
                sets,
            )
        if before is not None:
            got = before(ql, qr, pool, sets[0], SCALE, "fp8_ds_mla")
            torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
            ab: dict[str, list[float]] = {"before": [], "now": []}
            for _ in range(3):
                for name, fn in (("before", before), ("now", smt.sparse_mla_decode_triton)):
                    ab[name].append(graph_us(
                        lambda idx, fn=fn, ql=ql, qr=qr: fn(ql, qr, pool, idx, SCALE, "fp8_ds_mla"),
                        sets,
                    ))  # fmt: skip
            row["before_us"] = statistics.median(ab["before"])
            row["now_us"] = statistics.median(ab["now"])
        print(row, flush=True)
        rows.append(row)
    return rows


def gluon_vs_triton(
    pool: torch.Tensor, batches: list[int], splits: list[int], variants: list[str]
) -> list[dict]:
    """The Gluon kernel (`sparse_mla_gluon`, and other versions' module files ``variants``)
    beside the Triton one, fp8 rows: each checked against the reference (a tenth of the
    indices -1 over a NaN-poisoned null row, one token with none), then µs of one call
    (kernel + combine, CUDA-graph replays of fresh index sets) in three alternating rounds
    (medians); the committed Gluon kernel also at each of ``splits``."""
    from hisparse.attention import sparse_mla_gluon as smg

    fmt = "fp8_ds_mla"
    kernels = {"triton": lambda ql, qr, idx, n=None: smt.sparse_mla_decode_triton(
        ql, qr, pool, idx, SCALE, fmt, num_splits=n)}  # fmt: skip
    for name, path in [("gluon", None), *((os.path.basename(v)[:-3], v) for v in variants)]:
        fn = smg.sparse_mla_decode_gluon if path is None else baseline_function(
            path, "sparse_mla_decode_gluon")  # fmt: skip
        kernels[name] = lambda ql, qr, idx, n=None, fn=fn: fn(
            ql, qr, pool, idx, SCALE, num_splits=n)  # fmt: skip
    pool[0, 0].fill_(0xFF)  # NaN bytes in the row -1 entries would read unmasked
    rows = []
    for t in batches:
        g = torch.Generator(device=DEV).manual_seed(300 + t)
        n_rows = pool.shape[0] * pool.shape[1]
        n_sets = min(128, max(4, math.ceil(GRAPH_BYTES / smt.decode_bytes(t, H, K, fmt))))
        sets = [torch.randint(1, n_rows, (t, K), generator=g, device=DEV, dtype=torch.int32)
                for _ in range(n_sets)]  # fmt: skip
        ql = torch.randn(t, H, C, generator=g, device=DEV).bfloat16()
        qr = torch.randn(t, H, R, generator=g, device=DEV).bfloat16()
        chk = sets[0].clone()
        chk[torch.rand(chk.shape, generator=g, device=DEV) < 0.1] = -1
        if t > 1:
            chk[-1] = -1  # a token with no row: out 0, lse -inf
        ref_o, ref_l = sparse_mla_decode_reference(ql, qr, pool, chk, SCALE, fmt)
        fin = torch.isfinite(ref_l)
        splits_t = smt.num_splits_for(t, H, K, smt.DecodeConfig(), DEV)
        row: dict = {"tokens": t, "model_splits": splits_t}
        for name, fn in kernels.items():
            o, lse = fn(ql, qr, chk)
            torch.cuda.synchronize()
            row[name] = {
                "err": (o.float() - ref_o.float()).abs().max().item(),
                "rel": ((o.float() - ref_o.float()).norm() / ref_o.float().norm()).item(),
                "lse_err": (lse[fin] - ref_l[fin]).abs().max().item(),
                "ok": bool((lse[~fin] == float("-inf")).all().item())
                and not bool(o.isnan().any().item()),
            }  # fmt: skip
        rounds: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(3):
            for name, fn in kernels.items():
                rounds[name].append(
                    graph_us(lambda idx, fn=fn, ql=ql, qr=qr: fn(ql, qr, idx), sets)
                )
        for name in kernels:
            row[name]["us"] = statistics.median(rounds[name])
        row["gluon_split_us"] = {
            n: graph_us(lambda idx, n=n, ql=ql, qr=qr: kernels["gluon"](ql, qr, idx, n), sets)
            for n in splits
        }  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "bench_sparse_mla.json")
    )
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--sweep", action="store_true", help="time every shape in CONFIGS")
    ap.add_argument("--prefill", type=int, default=PREFILL_TOKENS, help="0 = no prefill case")
    ap.add_argument("--splits", help="time these split counts per batch (fp8 rows) instead")
    ap.add_argument("--baseline", help="with --splits: a module file whose kernel runs beside")
    ap.add_argument("--gluon", action="store_true", help="the Gluon kernel beside the Triton one")
    ap.add_argument("--variants", default="", help="with --gluon: other Gluon module files")
    args = ap.parse_args()
    t0 = time.time()
    if args.gluon:
        batches = [int(x) for x in args.batches.split(",")]
        splits = [int(x) for x in (args.splits or "1,2,4").split(",")]
        variants = [v for v in args.variants.split(",") if v]
        rows = gluon_vs_triton(make_pool("fp8_ds_mla", args.pool_gib), batches, splits, variants)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gluon": rows}, f, indent=1)
        names = [k for k in rows[0] if isinstance(rows[0][k], dict) and "us" in rows[0][k]]
        print(
            "\nsparse MLA decode, fp8_ds_mla, H=128, top_k 2048: µs (medians of 3 rounds), "
            "max abs error vs the reference; gluon at each split count"
        )
        print(f"{'T':>5} {'splits':>6} " + " ".join(f"{n:>16}" for n in names) + " "
              + " ".join(f"{'G/' + str(n):>8}" for n in splits))  # fmt: skip
        for r in rows:
            cells = [f"{r[n]['us']:>8.1f} {r[n]['err']:>6.0e}{'' if r[n]['ok'] else '!'}"
                     for n in names]  # fmt: skip
            print(f"{r['tokens']:>5} {r['model_splits']:>6} " + " ".join(f"{c:>16}" for c in cells)
                  + " " + " ".join(f"{r['gluon_split_us'][n]:>8.1f}" for n in splits))  # fmt: skip
        return
    if args.splits:
        splits = [int(x) for x in args.splits.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        before = baseline_function(args.baseline, "sparse_mla_decode_triton")
        rows = split_sweep(make_pool("fp8_ds_mla", args.pool_gib), batches, splits, before)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "split_sweep": rows}, f, indent=1)
        print("\nsparse MLA decode (kernel + combine), fp8_ds_mla, µs by split count; * = model")
        print(f"{'T':>5} " + " ".join(f"{n:>8}" for n in splits))
        for r in rows:
            cells = [f"{r['us'][n]:>7.1f}{'*' if n == r['model_splits'] else ' '}" for n in splits]
            print(f"{r['tokens']:>5} " + " ".join(cells) + f"   model: {r['model_splits']}")
        if before is not None:
            print("\n--baseline (before) vs now at the model's split count, µs, medians of 3:")
            for r in rows:
                print(f"{r['tokens']:>5} {r['before_us']:>8.1f} {r['now_us']:>8.1f} "
                      f"{r['before_us'] / r['now_us']:>6.3f}x")  # fmt: skip
        return
    configs = CONFIGS if args.sweep else [smt.default_config(1, H)]
    if smt.default_config(1, H) not in configs:
        configs = [smt.default_config(1, H), *configs]
    precompile(configs)
    props = torch.cuda.get_device_properties(DEV)
    copy_gbs = hbm_copy_gbs()
    mm_tflops = matmul_tflops()
    print(f"{props.name}: HBM d2d copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s")
    results = []
    for fmt in ("fp8_ds_mla", "bf16"):
        pool = make_pool(fmt, args.pool_gib)
        for t in (int(x) for x in args.batches.split(",")):
            results.append(bench_case(fmt, pool, t, copy_gbs, configs))
        if args.prefill:
            # Prefill: many tokens, each with its own top-k; the best decode shapes only.
            big = [r for r in results if r["fmt"] == fmt and r["best"] is not None]
            pick = {smt.DecodeConfig(**r["best"]["config"]) for r in big[-1:]}
            pick.add(smt.default_config(args.prefill, H))
            results.append(
                bench_case(fmt, pool, args.prefill, copy_gbs, sorted(pick, key=str), False)
            )
        del pool
        torch.cuda.empty_cache()
    doc = {
        "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
        "copy_gbs": copy_gbs, "matmul_tflops": mm_tflops, "pool_gib": args.pool_gib,
        "heads": H, "top_k": K, "results": results, "wall_s": time.time() - t0,
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)

    print(
        f"\nsparse MLA decode, H={H}, top_k={K}, bf16 q; HBM copy {copy_gbs:.0f} GB/s "
        f"(100% = that), matmul {mm_tflops:.0f} TFLOP/s; tile shape block_h,block_n,warps,stages"
    )
    if args.sweep:  # every shape, µs (graph replay); * = failed the reference check
        labels = [_label(c) for c in configs]
        print(f"{'rows':>10} {'T':>5} " + " ".join(f"{lb:>13}" for lb in labels))
        for r in results:
            by = {e.get("label"): e for e in r["configs"]}
            cells = []
            for lb in labels:
                e = by.get(lb)
                if e is None or "us" not in e:
                    cells.append(f"{'-':>13}")
                else:
                    cells.append(f"{e['us']:>12.1f}{'' if e['ok'] else '*'}")
            print(f"{r['fmt']:>10} {r['tokens']:>5} " + " ".join(cells))
        print()
    hdr = (
        f"{'rows':>10} {'T':>5} {'shape':>14} {'splits':>6} {'µs':>8} {'eager':>7} "
        f"{'GB/s':>6} {'%copy':>5} {'TFLOP/s':>7} {'%mm':>4} {'ref µs':>8} {'×ref':>6} "
        f"{'rel err':>8} {'default µs':>10}"
    )
    print(hdr)
    for r in results:
        b = r["best"]
        if b is None:
            print(f"{r['fmt']:>10} {r['tokens']:>5}  no tile shape passed")
            continue
        d = r.get("default") or {}
        print(
            f"{r['fmt']:>10} {r['tokens']:>5} {b['label']:>14} {b['splits']:>6} {b['us']:>8.1f} "
            f"{b.get('eager_us', float('nan')):>7.1f} {b['gbs']:>6.0f} {r['pct_hbm']:>5.1f} "
            f"{b['tflops']:>7.1f} {b['tflops'] / mm_tflops * 100:>4.0f} {r['ref_us']:>8.1f} "
            f"{r['ref_us'] / b['us']:>6.1f} {b['rel_err']:>8.1e} {d.get('us', float('nan')):>10.1f}"
        )


if __name__ == "__main__":
    main()
