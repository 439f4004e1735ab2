"""``hisparse simulate``: running requests, admission waits, preemptions, hit rate and H2D
traffic of a request trace against a KV layout, on the CPU, without a model or a GPU.

The engine's own scheduler and block accounting run on the meta device; the top-k follows
the benchmarks' replay (``--topk-overlap``, the same selections `hisparse bench` makes);
the hot buffers' LRU is the reference resolve's. Step times are modelled: a fixed cost, a
cost per decoding request, the PCIe time of the step's misses at measured rates
(``--pcie-rates``, default the H200 figures of docs/benchmarks.md §18) and prefill tokens at
``--prefill-tok-s``.

Traffic: ``--concurrency N`` (the bench's shape: N requests at t = 0, at most N running),
a synthetic trace (``--num-requests``, Poisson ``--arrival-rate``, lognormal lengths) or a
JSONL file (``--trace``: one ``{"arrival", "input_len", "output_len"}`` per line).
``--compare BENCH_JSON`` takes every setting not given here from a `hisparse bench --json`
file and prints predicted against measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hisparse.cli_options import add_option
from hisparse.config import HiSparseConfigError, check_gib, default_offload
from hisparse.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hisparse.models.source import require_dsa, resolve_model_source
from hisparse.sim.data_parallel import simulate_data_parallel
from hisparse.sim.pcie import RateTable
from hisparse.sim.simulator import (
    DEFAULT_DECODE_MS,
    DEFAULT_DECODE_MS_PER_REQUEST,
    DEFAULT_PREFILL_TOK_S,
    SimSettings,
    simulate,
)
from hisparse.sim.trace import TraceRequest, load_trace, synthetic_trace

#: options `--compare` may take from the bench's settings (bench name -> ours)
_FROM_BENCH = {
    "model": "model", "input_len": "input_len", "output_len": "output_len",
    "concurrency": "concurrency", "kv_placement": "kv_placement",
    "topk_overlap": "topk_overlap", "gpu_memory_gib": "gpu_memory_gib",
    "host_pool_gib": "host_pool_gib", "max_model_len": "max_model_len",
    "hot_buffer_rows": "hot_buffer_rows", "sparse_top_k": "sparse_top_k",
    "kv_format": "kv_format", "block_size": "block_size",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "schedule": "schedule", "seed": "seed", "offload": "offload",
    "shared_prefix": "shared_prefix",
}  # fmt: skip

#: what `--compare` sets side by side: (bench / simulate key, label, relative tolerance)
COMPARED = (
    ("peak_running", "peak running", 0.05),
    ("bytes_swapped", "swapped bytes", 0.15),
    ("hit_rate", "hit rate", None),
    ("preemptions", "preemptions", None),
    ("decode_steps", "decode steps", None),
)


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a request trace: running requests, hit rate, PCIe load (CPU only)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="a preset (deepseek-v3.2, glm-5), a DSA checkpoint folder "
                   "or its config.json (required unless --compare gives it)")  # fmt: skip
    t = p.add_argument_group("traffic")
    t.add_argument("--concurrency", help="the bench's shape: N requests at t=0, at most N "
                   "running; a list (1,8) runs each (default: none, give this, "
                   "--num-requests or --trace)")  # fmt: skip
    t.add_argument("--trace", type=Path, help="JSONL trace (arrival, input_len, output_len) "
                   "(default: none)")  # fmt: skip
    t.add_argument("--num-requests", type=int, help="synthetic trace of this many requests "
                   "(default: none)")  # fmt: skip
    t.add_argument("--arrival-rate", type=float, default=0.0,
                   help="synthetic: Poisson arrivals per second, 0: all at t=0 "
                   "(default: %(default)s)")  # fmt: skip
    t.add_argument("--input-len", type=int, help="prompt tokens (synthetic: the median) "
                   "(default: the bench's with --compare)")  # fmt: skip
    t.add_argument("--output-len", type=int, help="new tokens (synthetic: the median) "
                   "(default: the bench's with --compare)")  # fmt: skip
    t.add_argument("--input-sigma", type=float, default=0.0,
                   help="lognormal sigma, 0: fixed (default: %(default)s)")  # fmt: skip
    t.add_argument("--output-sigma", type=float, default=0.0,
                   help="lognormal sigma, 0: fixed (default: %(default)s)")  # fmt: skip
    add_option(t, "--max-num-seqs", default=None,
               help="most requests running at once (default: 256 for a trace, N for "
               "--concurrency N)")  # fmt: skip
    t.add_argument(
        "--shared-prefix",
        type=int,
        help="every prompt starts with the same N tokens (one document; prefix caching on, as "
        "the engine's default) (default: none)",
    )
    e = p.add_argument_group("engine (as hisparse bench)")
    e.add_argument("--kv-placement", help="placements: hisparse, gpu or both, comma-separated "
                   "(default: hisparse)")  # fmt: skip
    add_option(e, "--gpu-memory-gib", help="GPU memory for the KV cache, GiB (required unless "
               "--compare gives it)")  # fmt: skip
    add_option(e, "--host-pool-gib", help="pinned host pool, GiB (default: the engine's rule, "
               "or the bench's with --compare)")  # fmt: skip
    add_option(e, "--max-model-len", help="most tokens of one request (default: the longest "
               "input + output)")  # fmt: skip
    add_option(e, "--hot-buffer-rows")
    add_option(e, "--sparse-top-k")
    e.add_argument("--kv-format", help="KV row format: auto, fp8_ds_mla, bf16 or fp32 "
                   "(default: auto)")  # fmt: skip
    add_option(e, "--block-size", default=None, help="tokens per KV block (default: 64)")
    add_option(
        e,
        "--max-num-batched-tokens",
        default=None,
        help="prompt tokens per engine step (default: 16384, the synthetic bench's)",
    )
    e.add_argument("--schedule", choices=("mixed", "prefill-first"),
                   help="as hisparse bench (default: mixed)")  # fmt: skip
    e.add_argument("--data-parallel-size", type=int, default=1,
                   help="ranks of data-parallel attention, each with its own pools and "
                   "--max-num-seqs; requests routed as the engine routes them "
                   "(default: %(default)s)")  # fmt: skip
    add_option(e, "--offload")
    e.add_argument("--topk-overlap", help="replayed top-k step overlap (default: 0.8)")
    e.add_argument("--seed", type=int, help="seed of the synthetic trace and replay "
                   "(default: 0)")  # fmt: skip
    e.add_argument("--target", choices=("cuda", "cpu"), default="cuda",
                   help="the engine's device: its default dtype picks the row format "
                   "(default %(default)s)")  # fmt: skip
    e.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding: drafts per decoding request and step; the hot "
                   "buffers of max_query_len = K + 1 and each step's K + 1 rows per request "
                   "(default: 0, none)")  # fmt: skip
    e.add_argument("--spec-acceptance", type=float, default=0.6,
                   help="with --num-speculative-tokens: the chance a draft is taken after "
                   "the ones before it were (the simulator has no tokens; default: "
                   "%(default)s)")  # fmt: skip
    m = p.add_argument_group("model of time and sampling")
    m.add_argument("--pcie-rates", type=Path, help="JSON rate table (reads, span_bytes, "
                   "gb_s); default: docs/benchmarks.md §18, H200")  # fmt: skip
    m.add_argument("--decode-ms", type=float, default=DEFAULT_DECODE_MS,
                   help="decode step cost beside PCIe, ms (default %(default)s)")  # fmt: skip
    m.add_argument("--decode-ms-per-request", type=float, default=DEFAULT_DECODE_MS_PER_REQUEST,
                   help="and per decoding request, ms (default %(default)s)")  # fmt: skip
    m.add_argument("--prefill-tok-s", type=float, default=DEFAULT_PREFILL_TOK_S,
                   help="prefill tokens per second (default %(default)g)")  # fmt: skip
    m.add_argument("--sim-leaders", type=int, help="index-group leaders whose hot buffers "
                   "are simulated, the others counted as their average (default all)")  # fmt: skip
    m.add_argument("--sample-requests", type=float, default=1.0,
                   help="fraction of requests whose hot buffers are simulated, the others "
                   "counted as their running mean (default 1: all, exact)")  # fmt: skip
    m.add_argument("--id-offset", type=int, help="first request id (default: what the bench "
                   "numbers after its warm-up with --compare, else 0)")  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write results (and every step) here "
                   "(default: none)")  # fmt: skip
    o.add_argument("--plot", type=Path, help="PNG: running requests and H2D GB/s over time "
                   "(default: none)")  # fmt: skip
    o.add_argument("--compare", type=Path, help="a hisparse bench --json file: its settings "
                   "fill the options not given; prints predicted vs measured "
                   "(default: none)")  # fmt: skip
    p.set_defaults(handler=run_simulate)


# -- settings ---------------------------------------------------------------------------------


#: a bench JSON's settings of before the flags' renaming (hisparse.cli_options.ALIASES)
_OLD_BENCH_KEYS = {
    "hot_buffer": "hot_buffer_rows", "top_k": "sparse_top_k",
    "max_batched_tokens": "max_num_batched_tokens",
}  # fmt: skip


def _fill_from_bench(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.compare is None:
        return None
    doc = json.loads(args.compare.read_text())
    bench = dict(doc.get("settings", {}))
    for old, new in _OLD_BENCH_KEYS.items():
        if old in bench and new not in bench:
            bench[new] = bench[old]
    for ours, theirs in _FROM_BENCH.items():
        if getattr(args, ours) is None and bench.get(theirs) is not None:
            setattr(args, ours, bench[theirs])
    if args.host_pool_gib is None:  # the pool the bench's engine sized, if it says
        pools = [r["host_pool_gib"] for r in doc.get("results", []) if r.get("host_pool_gib")]
        if pools:
            args.host_pool_gib = max(pools)
    if args.offload is None and "offload" not in bench:
        args.offload = "always"  # a bench JSON from before the policy existed
    if args.max_num_batched_tokens is None and bench.get("prefill") == "model":
        args.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the bench's, real prefill
    return doc


def bench_id_offsets(
    bench: dict[str, Any], conc: list[int], target: str, placement: str | None = None
) -> list[int]:
    """The first request id of each timed cell of a `hisparse bench` run: recorded in its
    rows (``first_request_id``), or for older runs reckoned from its settings: its warm-up
    cells (one per padded decode-graph size up to the cell's, or just the cell's size without
    graphs) take ids first, and every cell of one engine continues the count."""
    from hisparse.engine.cuda_graphs import padded_sizes

    recorded = {
        r.get("concurrency"): r.get("first_request_id")
        for r in bench.get("results", [])
        if placement is None or r.get("placement") == placement
    }
    if all(recorded.get(n) is not None for n in conc):
        return [int(recorded[n]) for n in conc]  # type: ignore[arg-type]
    s = bench.get("settings", {})
    # CUDA graphs: a CUDA device (the bench's --device, else the device simulated)
    graphs = (s.get("device") or target).startswith("cuda") and not s.get("timing")
    graphs = graphs and int(s.get("tensor_parallel_size") or 1) == 1
    sizes = padded_sizes(max(conc))
    out, nxt = [], 0
    for n in conc:
        if not s.get("no_warmup"):
            if graphs:
                top = next(b for b in sizes if b >= n)
                nxt += sum(b for b in sizes if b < top) + n
            else:
                nxt += n
        out.append(nxt)
        nxt += n
    return out


def _overlap(value: object) -> float:
    """``--topk-overlap`` (or a bench's) as a fraction; the model's own selections (a bench
    run with ``--topk-overlap off``) cannot be replayed without the model."""
    try:
        overlap = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise HiSparseConfigError(
            f"--topk-overlap={value!r}: the simulator replays selections with a step overlap in "
            "[0, 1] (the bench's --topk-overlap); a run with the model's own top-k cannot be "
            "simulated: give --topk-overlap 0.8, say"
        ) from None
    if not 0.0 <= overlap <= 1.0:
        raise HiSparseConfigError(f"--topk-overlap={value!r} must be in [0, 1]")
    return overlap


def settings_for(
    args: argparse.Namespace, placement: str, n: int | None, trace: list[TraceRequest]
) -> SimSettings:
    longest = max(t.input_len + t.output_len for t in trace)
    overlap = 0.8 if args.topk_overlap is None else _overlap(args.topk_overlap)
    return SimSettings(
        model=str(args.model),
        placement=placement,
        gpu_memory_gib=float(args.gpu_memory_gib),
        max_model_len=args.max_model_len or longest,
        max_num_seqs=n if n is not None else (args.max_num_seqs or 256),
        max_num_batched_tokens=args.max_num_batched_tokens or 16384,
        block_size=args.block_size or 64,
        top_k=args.sparse_top_k,
        hot_buffer=args.hot_buffer_rows,
        host_pool_gib=args.host_pool_gib,
        kv_format=args.kv_format or "auto",
        topk_overlap=overlap,
        seed=args.seed or 0,
        schedule=args.schedule or "mixed",
        offload=args.offload,
        sim_leaders=args.sim_leaders,
        sample_requests=args.sample_requests,
        rates=RateTable.load(args.pcie_rates),
        decode_ms=args.decode_ms,
        decode_ms_per_request=args.decode_ms_per_request,
        prefill_tok_s=args.prefill_tok_s,
        target=args.target,
        shared_prefix=args.shared_prefix or 0,
        num_speculative_tokens=args.num_speculative_tokens,
        spec_acceptance=args.spec_acceptance,
    )


def _cells(args: argparse.Namespace) -> list[tuple[int | None, list[TraceRequest]]]:
    """(max_num_seqs or None, trace) per run."""
    if args.trace is not None:
        return [(None, load_trace(args.trace))]
    if args.input_len is None or args.output_len is None:
        raise HiSparseConfigError("give --input-len and --output-len (or --trace FILE)")
    kw = dict(input_len=args.input_len, output_len=args.output_len,
              input_sigma=args.input_sigma, output_sigma=args.output_sigma,
              max_len=args.max_model_len, seed=args.seed or 0)  # fmt: skip
    if args.num_requests is not None:
        return [(None, synthetic_trace(args.num_requests, rate=args.arrival_rate, **kw))]
    if args.concurrency is None:
        raise HiSparseConfigError("give --concurrency N, --num-requests N or --trace FILE")
    try:
        conc = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        conc = []
    if not conc or any(c < 1 for c in conc):
        raise HiSparseConfigError(f"--concurrency={args.concurrency!r}: positive integers")
    return [(n, synthetic_trace(n, **kw)) for n in conc]


# -- the command ------------------------------------------------------------------------------


def run_simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bench = _fill_from_bench(args)
    if args.model is None or args.gpu_memory_gib is None:
        raise HiSparseConfigError("give --model and --gpu-memory-gib (or --compare BENCH_JSON)")
    from hisparse.kv.v4_plan import v4_config_of

    if v4_config_of(args.model) is not None:  # a V4 preset or checkpoint (design §20.2)
        if args.data_parallel_size > 1:
            raise HiSparseConfigError(
                "--data-parallel-size: DeepSeek-V4 has no data-parallel attention yet (the "
                "engine refuses it); simulate one GPU"
            )
    else:
        src = resolve_model_source(args.model, name="--model")
        require_dsa(src, "simulate")
        args.model = str(src.path) if src.kind == "checkpoint" else src.name
    check_gib("--gpu-memory-gib", args.gpu_memory_gib)
    if args.offload is None:  # the JSON's settings name the policy simulated
        args.offload = default_offload()
    placements = [p.strip() for p in str(args.kv_placement or "hisparse").split(",") if p]
    if not placements or any(p not in ("hisparse", "gpu") for p in placements):
        raise HiSparseConfigError(f"--kv-placement={args.kv_placement!r}: hisparse, gpu or both")
    if args.data_parallel_size < 1:
        raise HiSparseConfigError(f"--data-parallel-size {args.data_parallel_size}: must be >= 1")
    if args.data_parallel_size > 1 and bench is not None:
        raise HiSparseConfigError("--compare checks one rank's bench: drop --data-parallel-size")
    cells = _cells(args)
    conc = [n for n, _ in cells if n is not None]
    console = Console(width=max(Console().width, 160), highlight=False)
    results: list[dict[str, Any]] = []
    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        for placement in placements:
            offsets = (
                bench_id_offsets(bench, conc, args.target, placement)
                if bench is not None and args.id_offset is None and conc
                else [args.id_offset or 0] * len(cells)
            )
            for (n, trace), off in zip(cells, offsets, strict=True):
                s = settings_for(args, placement, n, trace)
                s.id_offset = off
                task = progress.add_task(f"{placement} x{n or len(trace)}", total=len(trace))
                report = lambda d, _t, task=task: progress.update(task, completed=d)  # noqa: E731
                if args.data_parallel_size > 1:
                    row = simulate_data_parallel(s, trace, args.data_parallel_size, report)
                    row["placement"] = f"{placement} DP {args.data_parallel_size}"
                else:
                    row = simulate(s, trace, report)
                row.update(concurrency=n, max_num_seqs=s.max_num_seqs, id_offset=off)
                results.append(row)
    console.print(results_table(results))
    comparison = compare(results, bench) if bench is not None else None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k != "handler"}  # fmt: skip
        args.json.write_text(json.dumps(
            dict(settings=settings, results=results, comparison=comparison)))  # fmt: skip
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        console.print(write_plot(results, args.plot))
    if comparison is not None:
        console.print(comparison_table(comparison))
        return 0 if all(c["within"] is not False for c in comparison) else 1
    return 0


def results_table(results: list[dict[str, Any]]) -> Table:
    t = Table(title="Simulated", title_justify="left")
    cols = ("placement", "requests", "max seqs", "peak running", "mean running", "preempt.",
            "wait p50/p95 s", "hit rate", "swapped GB", "H2D GB/s", "PCIe share",
            "sim. s", "wall s")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "placement" else "right")

    def f(v: float | None, d: int = 2) -> str:
        return "-" if v is None else f"{v:,.{d}f}"

    for r in results:
        t.add_row(
            r["placement"], str(r["requests"]), str(r["max_num_seqs"]), str(r["peak_running"]),
            f(r["mean_running"], 1), str(r["preemptions"]),
            f"{f(r['admission_wait_p50'])}/{f(r['admission_wait_p95'])}",
            "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%",
            f(r["bytes_swapped"] / 1e9, 3), f(r["h2d_gb_s"]),
            f"{100 * r['pcie_fraction']:.0f}%", f(r["simulated_seconds"]), f(r["wall_seconds"]),
        )  # fmt: skip
    return t


def compare(results: list[dict[str, Any]], bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against measured per (placement, concurrency) both have; ``within``: inside
    the tolerance (None: no tolerance for that quantity)."""
    measured = {(r["placement"], r["concurrency"]): r for r in bench.get("results", [])}
    out = []
    for r in results:
        m = measured.get((r["placement"], r["concurrency"]))
        if m is None:
            continue
        for key, label, tol in COMPARED:
            p, v = r.get(key), m.get(key)
            if p is None or v is None:
                continue
            err = (p - v) / v if v else (0.0 if p == v else None)
            within = None
            if tol is not None:
                within = err is not None and abs(err) <= tol
            out.append(dict(placement=r["placement"], concurrency=r["concurrency"], quantity=key,
                            label=label, predicted=p, measured=v, rel_error=err,
                            tolerance=tol, within=within))  # fmt: skip
    return out


def comparison_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="Predicted (hisparse simulate) vs measured (hisparse bench)",
              title_justify="left")  # fmt: skip
    for c in ("placement", "conc.", "quantity", "predicted", "measured", "error", "within"):
        t.add_column(c, justify="left" if c in ("placement", "quantity") else "right")
    for c in rows:
        fmt = (lambda v: f"{v:.4f}") if c["quantity"] == "hit_rate" else (lambda v: f"{v:,.0f}")
        t.add_row(
            c["placement"], str(c["concurrency"]), c["label"], fmt(c["predicted"]),
            fmt(c["measured"]), "-" if c["rel_error"] is None else f"{100 * c['rel_error']:+.1f}%",
            {True: f"yes (±{100 * (c['tolerance'] or 0):.0f}%)", False: "NO", None: "-"}[
                c["within"]],
        )  # fmt: skip
    return t


def write_plot(results: list[dict[str, Any]], path: Path) -> str:
    """PNG over simulated time per run: running and waiting requests; H2D GB/s of each
    decode step (its bytes over its modelled time) and the hit rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); skipped {path}"
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in results:
        cols = {c: i for i, c in enumerate(r["step_columns"])}
        steps = r["steps"]
        label = f"{r['placement']} x{r['concurrency'] or r['requests']}"
        dec = [s for s in steps if s[cols["decode"]]]
        t = [s[cols["t"]] for s in dec]
        line = axes[0].plot(t, [s[cols["running"]] for s in dec], label=f"{label} running")[0]
        axes[0].plot([s[cols["t"]] for s in steps], [s[cols["waiting"]] for s in steps],
                     ls="--", color=line.get_color(), label=f"{label} waiting")  # fmt: skip
        if r["placement"].startswith("hisparse"):
            axes[1].plot(t, [s[cols["bytes_swapped"]] / s[cols["seconds"]] / 1e9 for s in dec],
                         label=label)  # fmt: skip
            rate = [
                s[cols["hits"]] / (s[cols["hits"]] + s[cols["misses"]])
                if s[cols["hits"]] + s[cols["misses"]] else float("nan") for s in dec
            ]  # fmt: skip
            axes[2].plot(t, rate, label=label)
    titles = ("requests (decode steps: running)", "H2D GB/s per decode step", "hot-buffer hit rate")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("simulated time (s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
