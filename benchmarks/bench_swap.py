"""Swap-in cost on the GPU: resolve_residency and gather_compact vs the same run's ceilings.

Run on the GPU machine: ``PYTHONPATH=src python benchmarks/bench_swap.py [--quick]``.

* resolve: µs per call (one decode row per request, top_k 2048, block 64), for batch x miss
  rate x hot size, each timed call on a fresh top-k and the same starting hot state (full
  hot buffer; ``miss`` of each request's picks are not in it).
* group (``--only group``, in bench_group_gather.py): an index group's one-read-per-token
  `gather_compact_group` beside G separate per-layer gathers and one bulk copy.
* gather: µs and GB/s per call for batch x miss x row size, with a FRESH random sorted row set
  (from a pinned host pool of several GiB) per timed call, so the 60 MB L2 cannot serve
  repeats; beside three ceilings on the same bytes: one bulk pinned host->GPU copy, a plain
  one-row-per-program Triton gather of the same rows, and the naive path (CPU index_select
  into pinned staging, then one copy; host wall clock).

Each timed call is preceded by a GPU sleep so the CPU's launch latency stays outside the
events. Correctness against the reference is checked once. Prints a table last and writes
JSON to ``$OUT/bench_swap.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hisparse.runtime.ops import reference as ref
from hisparse.runtime.ops import triton_backend as tk
from hisparse.runtime.ops import triton_resolve as tr
from hisparse.testing.ops_cases import compare, make_resolve_case

DEV = torch.device("cuda")
K = 2048
BS = 64
SLEEP_CYCLES = 200_000  # ~100 µs: covers the CPU's launch of the timed call


def _timed(fn, iters: int, prepare) -> list[float]:
    """µs of ``fn(i)`` per iteration, by CUDA events, after ``prepare(i)`` (untimed)."""
    out = []
    for i in range(iters):
        prepare(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------- resolve


def _resolve_inputs(Q: int, H: int, miss: float, n_sets: int, seed: int):
    """Full hot buffers; each top-k row: (1-miss) hot positions, miss fresh ones."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    nb = (16 * H) // BS
    n_pos = nb * BS
    S = Q
    src_bt = (1 + torch.arange(Q * nb, device=DEV, dtype=torch.int32)).view(Q, nb)
    hot_bt = (1 + torch.arange(S * (H // BS), device=DEV, dtype=torch.int32)).view(S, -1)
    perm = torch.argsort(torch.rand(Q, n_pos, generator=g, device=DEV), dim=1)
    hot_pos = perm[:, :H]
    cold_pos = perm[:, H:]
    hot_rows = torch.gather(src_bt.long(), 1, hot_pos // BS) * BS + hot_pos % BS
    slot_perm = torch.argsort(torch.rand(S, H, generator=g, device=DEV), dim=1)
    hot_index = torch.empty(S, H, dtype=torch.int32, device=DEV)
    hot_index.scatter_(1, slot_perm, hot_rows.int())
    lru = torch.argsort(torch.rand(S, H, generator=g, device=DEV), dim=1).to(torch.int16)
    n_miss = round(miss * K)
    sets = []
    for _ in range(n_sets):
        hp = torch.gather(
            hot_pos, 1, torch.argsort(torch.rand(Q, H, generator=g, device=DEV))[:, : K - n_miss]
        )
        cp = torch.gather(
            cold_pos,
            1,
            torch.argsort(torch.rand(Q, cold_pos.shape[1], generator=g, device=DEV))[:, :n_miss],
        )
        row = torch.cat([hp, cp], 1)
        row = torch.gather(row, 1, torch.argsort(torch.rand(Q, K, generator=g, device=DEV)))
        sets.append(row.int())
    state = torch.arange(Q, dtype=torch.int32, device=DEV)
    row_req = torch.arange(Q, dtype=torch.int32, device=DEV)
    return dict(
        sets=sets, src_bt=src_bt, hot_bt=hot_bt, hot_index=hot_index, lru=lru,
        state=state, row_req=row_req,
    )  # fmt: skip


def bench_resolve(Q: int, H: int, miss: float, iters: int, max_rows: int | None) -> dict:
    inp = _resolve_inputs(Q, H, miss, n_sets=min(iters, 8), seed=Q * 7 + H + int(miss * 1e4))
    hi, lru = inp["hot_index"].clone(), inp["lru"].clone()
    topk = inp["sets"][0].clone()
    out = torch.empty(Q, K, dtype=torch.int32, device=DEV)
    ss = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sd = torch.empty_like(ss)
    sc = torch.empty(Q, dtype=torch.int32, device=DEV)
    vc = torch.empty(Q, dtype=torch.int32, device=DEV)
    hm = torch.empty(Q, 2, dtype=torch.int32, device=DEV)

    def prepare(i: int) -> None:
        hi.copy_(inp["hot_index"])
        lru.copy_(inp["lru"])
        topk.copy_(inp["sets"][i % len(inp["sets"])])

    def fn(i: int) -> None:
        tk.resolve_residency(
            topk, inp["row_req"], inp["state"], inp["src_bt"], None, inp["hot_bt"], hi, lru,
            BS, out, ss, sd, sc, vc, hm, max_rows_per_request=max_rows,
        )  # fmt: skip

    fn(0)  # compile
    ts = _timed(fn, iters, prepare)
    got_miss = int(hm[:, 1].sum()) / (Q * K)
    return {"us": _med(ts), "us_all": ts, "miss_measured": got_miss}


def graph_resolve_us(Q: int, H: int, miss: float, reps: int = 50) -> dict:
    """Cross-check of the sleep+events timing: CUDA-graph replays back to back.

    One graph restores the state and resolves, the other only restores; the difference per
    replay is the resolve kernel alone, without any launch latency.
    """
    inp = _resolve_inputs(Q, H, miss, n_sets=1, seed=5)
    hi, lru = inp["hot_index"].clone(), inp["lru"].clone()
    topk = inp["sets"][0]
    out = torch.empty(Q, K, dtype=torch.int32, device=DEV)
    ss = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sd, sc = torch.empty_like(ss), torch.empty(Q, dtype=torch.int32, device=DEV)

    def restore() -> None:
        hi.copy_(inp["hot_index"])
        lru.copy_(inp["lru"])

    def both() -> None:
        restore()
        tk.resolve_residency(
            topk, inp["row_req"], inp["state"], inp["src_bt"], None, inp["hot_bt"], hi, lru,
            BS, out, ss, sd, sc, max_rows_per_request=1,
        )  # fmt: skip

    both()
    torch.cuda.synchronize()
    res = {}
    for name, fn in (("restore", restore), ("restore+resolve", both)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        res[name] = a.elapsed_time(b) * 1e3 / reps
    res["resolve_us"] = res["restore+resolve"] - res["restore"]
    res.update(batch=Q, hot=H, miss=miss)
    return res


#: Knobs of `triton_resolve` each ablation variant sets (the rest stay at their defaults).
_KNOBS = (
    "RESOLVE_IMPL", "RESOLVE_WARPS", "RESOLVE_BH", "RESOLVE_LOG_BUCKETS", "RESOLVE_RANK_TILE",
    "RESOLVE_SORT_WINDOW", "RESOLVE_SPLIT_MAX_Q", "RESOLVE_SPLIT_PROGRAMS",
)  # fmt: skip


def ablate_resolve(
    cases: list[tuple[int, int, float]] | None = None,
    names: list[str] | None = None,
    reps: int = 50,
    on_timed: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Resolve kernels and settings: CUDA-graph µs of each, then each against the oracle.

    ``bucket`` is the one-program kernel (bucket table, no sort of the entries; the default
    above ``RESOLVE_SPLIT_MAX_Q`` requests) at its default settings; the ``bucket-`` ones change
    one knob: warps, hot-slot chunk, bucket count, the swap-list rank tile, how the swap list is
    ordered (``tl.sort`` of a 512-key window when the misses fit, the default; rank tiles only;
    a 1024-key window; ``pairs`` variants turn the window off, so they time the rank tiles);
    ``split`` spreads each request over 16 programs up to 32 requests, else 8 (``-pN``: N), in
    five launches (`triton_resolve_split`); the others keep one program per request.
    ``on_timed`` receives the timings before the (slower) oracle checks start.
    """
    defaults = {k: getattr(tr, k) for k in _KNOBS}
    pairs = {"RESOLVE_SORT_WINDOW": 0}  # rank tiles only: what the tile variants vary
    split = {"RESOLVE_IMPL": "split"}
    variants: list[tuple[str, dict]] = [
        ("bucket", {}),
        ("split", split),  # programs by batch: 16 up to 32 requests, else 8
        ("split-p8", {**split, "RESOLVE_SPLIT_PROGRAMS": 8}),
        ("split-p4", {**split, "RESOLVE_SPLIT_PROGRAMS": 4}),
        ("split-p16", {**split, "RESOLVE_SPLIT_PROGRAMS": 16}),
        ("split-p32", {**split, "RESOLVE_SPLIT_PROGRAMS": 32}),
        ("bucket-w16", {"RESOLVE_WARPS": 16}),
        ("bucket-w4", {"RESOLVE_WARPS": 4}),
        ("bucket-w32", {"RESOLVE_WARPS": 32}),
        ("bucket-pairs", pairs),  # rank tiles of 64 (the default before session 5)
        ("bucket-pairs-tile32", {**pairs, "RESOLVE_RANK_TILE": 32}),
        ("bucket-pairs-tile128", {**pairs, "RESOLVE_RANK_TILE": 128}),
        ("bucket-pairs-tile128-w16", {**pairs, "RESOLVE_RANK_TILE": 128, "RESOLVE_WARPS": 16}),
        ("bucket-pairs-tile256-w16", {**pairs, "RESOLVE_RANK_TILE": 256, "RESOLVE_WARPS": 16}),
        ("bucket-window1024", {"RESOLVE_SORT_WINDOW": 1024}),
        ("bucket-bh1024", {"RESOLVE_BH": 1024}),
        ("bucket-4x-buckets", {"RESOLVE_LOG_BUCKETS": 13}),
    ]
    if names is not None:
        unknown = set(names) - {n for n, _ in variants}
        if unknown:
            raise SystemExit(f"unknown --ablate-variants {sorted(unknown)}")
        variants = [v for v in variants if v[0] in names]
    if cases is None:
        cases = [(1, 4096, m) for m in (0.05, 0.2, 1.0)] + [(29, 4096, 0.2), (64, 4096, 0.05)]
    out = []
    for Q, H, miss in cases:
        for name, knobs in variants:
            for k, v in {"RESOLVE_SPLIT_MAX_Q": 0, **knobs}.items():  # one program unless split
                setattr(tr, k, v)
            try:
                r = graph_resolve_us(Q, H, miss, reps)
            except Exception as e:  # keep going; report the failure
                r = {"error": repr(e)[:300], "batch": Q, "hot": H, "miss": miss}
            finally:
                for k, v in defaults.items():
                    setattr(tr, k, v)
            r["variant"] = name
            out.append(r)
            print("ablate", r, flush=True)
    if on_timed is not None:
        on_timed(out)  # keep the timings even if the checks run out of time
    # Each kernel against the oracle on GPU-sized cases (few and many misses).
    for name, knobs in variants:
        for k, v in {"RESOLVE_SPLIT_MAX_Q": 0, **knobs}.items():
            setattr(tr, k, v)
        try:
            for reuse in (0.95, 0.0):
                case = make_resolve_case(
                    Q=64, K=K, H=4096, block_size=BS, seed=78, reuse=reuse, hot_fill=0.9,
                    p_neg=0.01,
                ).to(DEV)  # fmt: skip
                a, b = case.clone(), case.clone()
                ref.resolve_residency(*a.args())
                tk.resolve_residency(*b.args())
                torch.cuda.synchronize()
                bad = compare(a.state_and_outputs(), b.state_and_outputs())
                out.append({"variant": f"check-{name}-reuse{reuse}", "bad": bad})
                print("ablate check", name, reuse, bad, flush=True)
        except Exception as e:  # a failing variant is reported, the others still checked
            out.append({"variant": f"check-{name}", "bad": [f"error: {e!r}"[:300]]})
            print("ablate check", name, "ERROR", repr(e)[:300], flush=True)
        finally:
            for k, v in defaults.items():
                setattr(tr, k, v)
    return out


def _print_ablation(rows: list[dict]) -> None:
    """Variant x (batch, hot, miss) table of CUDA-graph µs per call, then the oracle checks."""
    timed = [r for r in rows if not r["variant"].startswith("check-")]
    cases = sorted({(r["batch"], r["hot"], r["miss"]) for r in timed})
    names = list(dict.fromkeys(r["variant"] for r in timed))
    cell = {(r["variant"], (r["batch"], r["hot"], r["miss"])): r for r in timed}
    print("resolve ablation, µs per call (CUDA-graph replays): batch/hot/miss")
    print(f"{'variant':>20} " + " ".join(f"{f'{q}/{h}/{m}':>14}" for q, h, m in cases))
    for n in names:
        vals = []
        for c in cases:
            r = cell.get((n, c))
            if r is None or "error" in r:
                vals.append("" if r is None else "ERROR")
            else:
                vals.append(f"{r['resolve_us']:.1f}")
        print(f"{n:>20} " + " ".join(f"{v:>14}" for v in vals))
    checks = [r for r in rows if r["variant"].startswith("check-")]
    bad = [r["variant"] for r in checks if r["bad"]]
    if not checks:
        print("oracle checks: not run (yet)")
    else:
        print(f"oracle checks ({len(checks)}):", "all equal" if not bad else f"DIFFER: {bad}")


def check_resolve_once() -> dict:
    """Reference vs Triton on one realistic batch (bit-exact outputs and state)."""
    case = make_resolve_case(
        Q=64, K=K, H=4096, block_size=BS, seed=77, reuse=0.95, hot_fill=0.9, p_neg=0.01
    ).to(DEV)
    a, b = case.clone(), case.clone()
    ref.resolve_residency(*a.args())
    tk.resolve_residency(*b.args())
    torch.cuda.synchronize()
    return {"resolve_bad": compare(a.state_and_outputs(), b.state_and_outputs())}


# ---------------------------------------------------------------------------- gather


@triton.jit
def _plain_gather(host_ptr, dev_ptr, src_ptr, dst_ptr, RW: tl.constexpr, RWP: tl.constexpr):
    """The plain baseline: one program per row, 16-byte loads, no ordering."""
    i = tl.program_id(0)
    s = tl.load(src_ptr + i).to(tl.int64) * RW
    d = tl.load(dst_ptr + i).to(tl.int64) * RW
    w = tl.arange(0, RWP)
    v = tl.load(host_ptr + tl.multiple_of(s, 4) + w, mask=w < RW)
    tl.store(dev_ptr + tl.multiple_of(d, 4) + w, v, mask=w < RW)


def bench_gather(
    pool: torch.Tensor, Q: int, miss: float, row_bytes: int, iters: int, H: int = 4096
) -> dict:
    n_host = (pool.numel() // (row_bytes * BS)) * BS
    host = pool[: n_host * row_bytes].view(n_host // BS, BS, row_bytes)
    host2d = pool[: n_host * row_bytes].view(n_host, row_bytes)
    n = max(1, round(miss * K))
    dev = torch.empty(Q * H // BS, BS, row_bytes, dtype=torch.uint8, device=DEV)
    ss = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sd = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sc = torch.full((Q,), n, dtype=torch.int32, device=DEV)
    flat_s = torch.empty(Q * n, dtype=torch.int32, device=DEV)
    flat_d = torch.empty(Q * n, dtype=torch.int32, device=DEV)
    nbytes = Q * n * row_bytes
    g = torch.Generator(device=DEV).manual_seed(Q * 131 + n + row_bytes)

    def prepare(i: int) -> None:
        src = torch.randint(0, n_host, (Q, H), generator=g, device=DEV, dtype=torch.int32)
        src[:, :n] = torch.sort(src[:, :n], dim=1).values
        ss.copy_(src)
        dst = torch.argsort(torch.rand(Q, H, generator=g, device=DEV), dim=1)
        sd.copy_(dst + torch.arange(Q, device=DEV)[:, None] * H)
        flat_s.copy_(ss[:, :n].reshape(-1))
        flat_d.copy_(sd[:, :n].reshape(-1))

    def ours(i: int) -> None:
        tk.gather_compact(host, dev, ss, sd, sc)

    rw = row_bytes // 4
    hw = host2d.view(torch.int32)
    dw = dev.view(-1, row_bytes).view(torch.int32)

    def plain(i: int) -> None:
        _plain_gather[(Q * n,)](hw, dw, flat_s, flat_d, RW=rw, RWP=triton.next_power_of_2(rw))

    bulk = _bulk_copy(pool, nbytes, iters)

    prepare(0)
    ours(0)
    plain(0)
    torch.cuda.synchronize()
    # Check: our gather equals the reference on this row set.
    ref_dev = dev.clone()
    dev.fill_(0x5A)
    ref_dev.fill_(0x5A)
    ours(0)
    ref.gather_compact(host, ref_dev, ss, sd, sc)
    torch.cuda.synchronize()
    ok = bool(torch.equal(dev, ref_dev))
    t_ours = _timed(ours, iters, prepare)
    t_plain = _timed(plain, iters, prepare)
    t_bulk = _timed(bulk, iters, lambda i: None)
    # Naive: CPU index_select into pinned staging + one copy (host wall clock).
    staging = torch.empty(Q * n, row_bytes, dtype=torch.uint8).pin_memory()
    dst_naive = torch.empty(Q * n, row_bytes, dtype=torch.uint8, device=DEV)
    t_naive = []
    for i in range(max(2, min(iters, 5))):
        prepare(i)
        idx = flat_s.long().cpu()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.index_select(host2d, 0, idx, out=staging)
        dst_naive.copy_(staging, non_blocking=True)
        torch.cuda.synchronize()
        t_naive.append((time.perf_counter() - t0) * 1e6)

    def gbps(us: float) -> float:
        return nbytes / (us * 1e-6) / 1e9

    res = {
        "rows": Q * n,
        "bytes": nbytes,
        "correct": ok,
        "ours_us": _med(t_ours),
        "plain_us": _med(t_plain),
        "bulk_us": _med(t_bulk),
        "naive_us": _med(t_naive),
    }
    for k in ("ours", "plain", "bulk", "naive"):
        res[f"{k}_gbps"] = gbps(res[f"{k}_us"])
    res["all"] = {"ours": t_ours, "plain": t_plain, "bulk": t_bulk, "naive": t_naive}
    return res


def _bulk_copy(pool: torch.Tensor, nbytes: int, iters: int) -> Callable[[int], None]:
    """The bulk-copy ceiling: call ``i`` copies ``nbytes`` from its own random offset of the
    pinned ``pool`` to the GPU (fresh bytes per call, as the gathers read)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    offs = torch.randint(0, pool.numel() - nbytes, (iters,)).tolist()

    def bulk(i: int) -> None:
        dst.copy_(pool[offs[i] : offs[i] + nbytes], non_blocking=True)

    return bulk


def _cells(r: dict, keys: tuple[str, ...]) -> str:
    """Table cells ``µs GB/s`` of the timed variants ``keys`` of result row ``r``."""
    return " | ".join(f"{r[k + '_us']:>7.1f} {r[k + '_gbps']:>5.1f}".rjust(14) for k in keys)


def _dump(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_swap.json"), "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", choices=["all", "resolve", "gather", "group"], default="all")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the rest after this")
    ap.add_argument("--ablate", action="store_true", help="resolve: time stages and kernels")
    ap.add_argument(
        "--ablate-cases", default=None, help="batch/hot/miss,... (e.g. 1/4096/0.2,29/4096/0.2)"
    )
    ap.add_argument("--ablate-variants", default=None, help="variant names, comma separated")
    args = ap.parse_args()
    if args.only == "group":
        from bench_group_gather import main_group  # (this script's folder is on sys.path)

        main_group(args)
        return
    batches = [1, 8, 64, 256]
    misses = [0.001, 0.05, 0.2, 1.0]
    hots = [4096, 8192]
    rows = [656, 1152, 768]
    iters = args.iters
    if args.quick:
        batches, misses, hots, rows, iters = [1, 64], [0.05, 1.0], [4096], [656], 5
    props = torch.cuda.get_device_properties(DEV)
    result: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "resolve": [],
        "gather": [],
    }
    t0 = time.time()
    if args.only == "gather":
        hots = []
    if args.ablate:  # the ablation only: its table, then stop
        cases = None
        if args.ablate_cases:
            cases = [
                (int(q), int(h), float(m))
                for q, h, m in (c.split("/") for c in args.ablate_cases.split(","))
            ]
        names = args.ablate_variants.split(",") if args.ablate_variants else None

        def keep(timed: list[dict]) -> None:
            result["ablate"] = timed
            _dump(result, args.out)
            _print_ablation(timed)

        result["ablate"] = ablate_resolve(cases, names, on_timed=keep)
        _dump(result, args.out)
        _print_ablation(result["ablate"])
        return
    if args.only == "resolve":
        rows = []
        result["graph_check"] = [
            graph_resolve_us(64, 4096, 0.05),
            graph_resolve_us(256, 8192, 0.05),
        ]
        print("graph", result["graph_check"], flush=True)
    result["check"] = check_resolve_once()
    print("check", result["check"], flush=True)
    for H in hots:
        for Q in batches:
            for miss in misses:
                for mr, label in ((1, "rows1"), (None, "default")):
                    if mr is None and not (Q == 64 and miss == 0.05):
                        continue
                    if time.time() - t0 > args.budget_s * 0.3:
                        continue
                    try:
                        r = bench_resolve(Q, H, miss, iters, mr)
                    except Exception as e:  # keep the grid going; report the failure
                        r = {"error": repr(e)[:300]}
                    r.update(batch=Q, hot=H, miss=miss, max_rows=label)
                    result["resolve"].append(r)
                    print("resolve", {k: v for k, v in r.items() if k != "us_all"}, flush=True)
    print(f"resolve grid took {time.time() - t0:.0f} s", flush=True)
    pool = torch.empty(int(args.pool_gib * 2**30), dtype=torch.uint8).pin_memory()
    chunk = 2**28
    for o in range(0, pool.numel(), chunk):
        m = min(chunk, pool.numel() - o)
        pool[o : o + m].copy_(torch.randint(0, 256, (m,), dtype=torch.uint8, device=DEV))
    for rb in rows:
        for Q in batches:
            for miss in misses:
                if time.time() - t0 > args.budget_s:
                    continue
                try:
                    r = bench_gather(pool, Q, miss, rb, iters)
                except Exception as e:
                    r = {"error": repr(e)[:300]}
                r.update(batch=Q, miss=miss, row_bytes=rb)
                result["gather"].append(r)
                print("gather", {k: v for k, v in r.items() if k != "all"}, flush=True)
                _dump(result, args.out)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    _dump(result, args.out)
    # Tables last.
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}")
    print("resolve µs (top_k 2048, 1 row/request; 'default' = default max_rows bound)")
    print(f"{'hot':>5} {'batch':>5} {'miss':>6} {'bound':>8} {'µs':>8} {'miss meas':>9}")
    for r in result["resolve"]:
        if "error" in r:
            print(f"{r['hot']:>5} {r['batch']:>5} {r['miss']:>6} {r['max_rows']:>8} ERROR")
            continue
        print(
            f"{r['hot']:>5} {r['batch']:>5} {r['miss']:>6} {r['max_rows']:>8} {r['us']:>8.1f} "
            f"{r['miss_measured']:>9.4f}"
        )
    print("gather (fresh sorted random rows each call): µs / GB/s")
    print(
        f"{'row B':>5} {'batch':>5} {'miss':>6} {'rows':>7} {'MB':>7} | {'ours':>14} | "
        f"{'plain 1row/prog':>15} | {'bulk copy':>14} | {'naive cpu':>14} | ok"
    )
    for r in result["gather"]:
        if "error" in r:
            print(f"{r['row_bytes']:>5} {r['batch']:>5} {r['miss']:>6} ERROR {r['error'][:80]}")
            continue
        cells = _cells(r, ("ours", "plain", "bulk", "naive"))
        print(
            f"{r['row_bytes']:>5} {r['batch']:>5} {r['miss']:>6} {r['rows']:>7} "
            f"{r['bytes'] / 1e6:>7.2f} | {cells} | {r['correct']}"
        )


if __name__ == "__main__":
    main()
