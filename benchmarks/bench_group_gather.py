"""Index-group gather on the GPU (``bench_swap.py --only group`` runs it): an index group's
one-read-per-token `gather_compact_group` for groups of 1 and 4 (656 B rows, token-major host
spans), 2K / 16K / 128K fresh random tokens per call, beside G separate per-layer gathers and
one bulk copy of the same bytes. Timing and output as in bench_swap.py (its helpers).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from bench_swap import BS, DEV, K, _bulk_copy, _cells, _dump, _med, _timed
from hisparse.runtime.ops import reference as ref
from hisparse.runtime.ops import triton_backend as tk
from hisparse.runtime.ops.triton_gather import group_tile

GROUP_ROW = 656
GROUP_TILES = [(512, 4), (1024, 4), (2048, 4), (2048, 8)]


def bench_group(pool: torch.Tensor, G: int, tokens: int, iters: int, H: int = 4096) -> dict:
    """One index group's swap-in of ``tokens`` fresh random tokens, 656 B rows.

    Host: the token-major span view ``[NB, BS, G * 656]`` over the pinned pool. Device: one
    block-outermost pool holding the G layers' pages side by side. Timed on the same fresh
    sorted token sets: the group gather (one span read per token), G separate per-layer
    gathers (each a 656 B row at stride G * 656), and one bulk copy of the same bytes.
    """
    rb = GROUP_ROW
    span_b = G * rb
    n_host = (pool.numel() // (span_b * BS)) * BS
    host = pool[: n_host * span_b].view(n_host // BS, BS, span_b)
    Q = max(1, tokens // K)
    n = tokens // Q
    dev = torch.empty(Q * H // BS, G, BS, rb, dtype=torch.uint8, device=DEV)
    devices = [dev[:, j] for j in range(G)]
    layer_hosts = [host[:, :, j * rb : (j + 1) * rb] for j in range(G)]
    ss = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sd = torch.empty(Q, H, dtype=torch.int32, device=DEV)
    sc = torch.full((Q,), n, dtype=torch.int32, device=DEV)
    nbytes = Q * n * span_b
    g = torch.Generator(device=DEV).manual_seed(G * 1009 + tokens)

    def prepare(i: int) -> None:
        src = torch.randint(0, n_host, (Q, H), generator=g, device=DEV, dtype=torch.int32)
        src[:, :n] = torch.sort(src[:, :n], dim=1).values
        ss.copy_(src)
        dst = torch.argsort(torch.rand(Q, H, generator=g, device=DEV), dim=1)
        sd.copy_(dst + torch.arange(Q, device=DEV)[:, None] * H)

    def group(i: int, tile: tuple[int, int] | None = None) -> None:
        tk.gather_compact_group(host, devices, ss, sd, sc, tile=tile)

    def per_layer(i: int) -> None:
        for hv, dv in zip(layer_hosts, devices, strict=True):
            tk.gather_compact(hv, dv, ss, sd, sc)

    bulk = _bulk_copy(pool, nbytes, iters)

    prepare(0)
    group(0)
    per_layer(0)
    for tile in GROUP_TILES:
        if tile[0] >= span_b // 16:
            group(0, tile)
    torch.cuda.synchronize()
    # Check against the reference once, and the per-layer path against the group path.
    dev.fill_(0x5A)
    ref_dev = torch.full_like(dev, 0x5A)
    group(0)
    ref.gather_compact_group(host, [ref_dev[:, j] for j in range(G)], ss, sd, sc)
    torch.cuda.synchronize()
    ok = bool(torch.equal(dev, ref_dev))
    dev.fill_(0x5A)
    per_layer(0)
    torch.cuda.synchronize()
    ok = ok and bool(torch.equal(dev, ref_dev))
    t_group = _timed(group, iters, prepare)
    t_layers = _timed(per_layer, iters, prepare)
    t_bulk = _timed(bulk, iters, lambda i: None)
    tiles = {}
    for tile in GROUP_TILES:
        if tile[0] >= span_b // 16 and tile != group_tile(span_b // 16):
            ts = _timed(lambda i, t=tile: group(i, t), max(5, iters // 2), prepare)
            tiles[f"{tile[0]}x{tile[1]}w"] = nbytes / (_med(ts) * 1e-6) / 1e9

    def gbps(us: float) -> float:
        return nbytes / (us * 1e-6) / 1e9

    res = {
        "G": G,
        "tokens": Q * n,
        "batch": Q,
        "bytes": nbytes,
        "correct": ok,
        "group_us": _med(t_group),
        "layers_us": _med(t_layers),
        "bulk_us": _med(t_bulk),
        "tile_default": list(group_tile(span_b // 16)),
        "tiles_gbps": tiles,
    }
    for k in ("group", "layers", "bulk"):
        res[f"{k}_gbps"] = gbps(res[f"{k}_us"])
    res["group_over_bulk"] = res["group_gbps"] / res["bulk_gbps"]
    res["all"] = {"group": t_group, "layers": t_layers, "bulk": t_bulk}
    return res


def _fill_pool(gib: float) -> torch.Tensor:
    """A pinned host pool of random bytes (much larger than the GPU's L2)."""
    pool = torch.empty(int(gib * 2**30), dtype=torch.uint8).pin_memory()
    chunk = 2**28
    for o in range(0, pool.numel(), chunk):
        m = min(chunk, pool.numel() - o)
        pool[o : o + m].copy_(torch.randint(0, 256, (m,), dtype=torch.uint8, device=DEV))
    return pool


def main_group(args: argparse.Namespace) -> None:
    """``--only group``: index groups of 1 and 4, 656 B rows, 2K / 16K / 128K tokens."""
    props = torch.cuda.get_device_properties(DEV)
    result: dict = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "group": [],
    }
    t0 = time.time()
    pool = _fill_pool(args.pool_gib)
    print(f"pool {args.pool_gib} GiB pinned+filled in {time.time() - t0:.1f} s", flush=True)
    for G in (1, 4):
        for tokens in (2048, 16384, 131072):
            try:
                r = bench_group(pool, G, tokens, args.iters)
            except Exception as e:  # keep the grid going; report the failure
                r = {"G": G, "tokens": tokens, "error": repr(e)[:300]}
            result["group"].append(r)
            print("group", {k: v for k, v in r.items() if k != "all"}, flush=True)
            _dump(result, args.out)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}")
    print("group gather, 656 B rows, fresh sorted random tokens per call: µs / GB/s")
    print(
        f"{'G':>2} {'tokens':>7} {'MB':>7} | {'group gather':>14} | {'G per-layer':>14} | "
        f"{'bulk copy':>14} | {'grp/bulk':>8} | ok | other tiles GB/s"
    )
    for r in result["group"]:
        if "error" in r:
            print(f"{r['G']:>2} {r['tokens']:>7} ERROR {r['error'][:90]}")
            continue
        cells = _cells(r, ("group", "layers", "bulk"))
        tiles = " ".join(f"{k}:{v:.1f}" for k, v in r["tiles_gbps"].items())
        print(
            f"{r['G']:>2} {r['tokens']:>7} {r['bytes'] / 1e6:>7.2f} | {cells} | "
            f"{r['group_over_bulk']:>8.2f} | {r['correct']} | {tiles}"
        )
