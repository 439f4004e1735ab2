"""``hisparse bench``: decode throughput, latency and capacity, HiSparse against all-GPU.

For each KV placement and each concurrency the same requests (random prompts of
``--input-len`` tokens, ``--output-len`` new tokens each, greedy, EOS ignored) run through one
engine per placement; the table shows requests done, the peak number holding KV at once
(prefilling or decoding) and decoding at once, decode tokens per second, time to first token
and time per output token (p50 / p95), the hot buffers' hit rate, KV bytes swapped in and the
host-to-device rate they needed, and (with ``--timing``) time spent in resolve and gather.
Then the ratios HiSparse / all-GPU per concurrency, a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hisparse.config import HiSparseConfigError, check_gib, default_offload

PLACEMENT_NAMES = {"hisparse": "HiSparse", "gpu": "all-GPU"}


def positive_int_or_default(text: str) -> int:
    """argparse ``type`` of an option whose omission means "use the default": 0 or a negative
    number is refused instead of silently standing for the default."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: omit it for the default, or give a positive number"
        )
    return value


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark decode: HiSparse against all-GPU placement",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--model", required=True, help="a DSA checkpoint folder (config.json)")
    bench.add_argument("--input-len", type=int, required=True, help="prompt tokens per request")
    bench.add_argument("--output-len", type=int, required=True, help="new tokens per request")
    bench.add_argument("--concurrency", default="1,8", help="requests per run, e.g. 1,8,64,256")
    bench.add_argument("--kv-placement", default="hisparse,gpu", help="hisparse,gpu or one")
    bench.add_argument(
        "--topk-overlap",
        default="0.8",
        help="replayed top-k with this step-to-step overlap (0..1), or 'off' for the "
        "model's own selection (default: %(default)s)",
    )
    bench.add_argument(
        "--prefill",
        choices=("synthetic", "model"),
        default="synthetic",
        help="synthetic: write prompt KV rows directly (fast; TTFT NOT measured; with "
        "--topk-overlap off the hot buffers start cold: no prefill selection warms them); "
        "model: run the real prefill (default: %(default)s)",
    )
    bench.add_argument(
        "--gpu-memory-gib", type=float, required=True, help="GPU KV cache budget, GiB"
    )
    bench.add_argument(
        "--host-pool-gib",
        type=float,
        default=None,
        help="HiSparse host pool (default: enough for the largest concurrency at "
        "--max-model-len, at most half the host memory available)",
    )
    bench.add_argument(
        "--max-model-len",
        type=positive_int_or_default,
        default=None,
        help="default: input + output length",
    )
    bench.add_argument(
        "--hot-buffer",
        type=int,
        default=None,
        help="hot rows per request and layer (default (max_query_len+1)*top_k)",
    )
    bench.add_argument("--top-k", type=int, default=None, help="default: the model's index_topk")
    bench.add_argument(
        "--offload",
        default=None,
        help="under_pressure (default): pages stay on the GPU while there is room; "
        "always: only tail pages on the GPU",
    )
    bench.add_argument("--kv-format", default="auto", help="fp8_ds_mla (auto), bf16, fp32")
    bench.add_argument("--block-size", type=int, default=64)
    bench.add_argument(
        "--max-batched-tokens",
        type=positive_int_or_default,
        default=None,
        help="prefill tokens per step (default: 16384 synthetic, 2048 model)",
    )
    bench.add_argument(
        "--schedule",
        choices=("mixed", "prefill-first"),
        default="mixed",
        help="mixed: decodes first, prompt chunks in the budget left; prefill-first: prompt "
        "chunks alone while any prompt is unfinished (default: %(default)s)",
    )
    bench.add_argument("--device", default=None)
    bench.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to shard the model over, one GPU each (default 1); see the README for torchrun",
    )
    bench.add_argument("--dtype", default="auto")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--timing",
        action="store_true",
        help="time resolve and gather with CUDA events (read after each run)",
    )
    bench.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the short warm-up run per placement (kernel compilation)",
    )
    bench.add_argument("--json", type=Path, default=None, help="write results here")
    bench.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    bench.set_defaults(
        handler=run_bench,
        builds_engine=True,
        flags={
            "HiSparseConfig.top_k": "--top-k",
            "HiSparseConfig.device_buffer_size": "--hot-buffer",
            "HiSparseConfig.host_pool_gib": "--host-pool-gib",
            "HiSparseConfig.offload": "--offload",
            "HiSparseConfig.block_size": "--block-size",
            "LLM.kv_format": "--kv-format",
            "LLM.dtype": "--dtype",
            "LLM.device": "--device",
            "LLM.gpu_memory_gib": "--gpu-memory-gib",
            "LLM.max_model_len": "--max-model-len",
            "LLM.max_num_batched_tokens": "--max-batched-tokens",
            "LLM.max_num_seqs": "--concurrency",
            "LLM.tensor_parallel_size": "--tensor-parallel-size",
            "BenchHooks.seed": "--seed",
            "BenchHooks.topk_overlap": "--topk-overlap",
        },
    )


# -- arguments -------------------------------------------------------------------------------


def parse_args_checked(args: argparse.Namespace) -> dict[str, Any]:
    """Validated settings from ``args``; raises `HiSparseConfigError` with the fix."""
    try:
        conc = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        raise HiSparseConfigError(
            f"--concurrency={args.concurrency!r}: give positive integers separated by commas, "
            "e.g. 1,8,64"
        ) from None
    if not conc or any(c < 1 for c in conc):
        raise HiSparseConfigError(f"--concurrency={args.concurrency!r}: each must be >= 1")
    _refuse_duplicates("--concurrency", args.concurrency, conc)
    placements = [p.strip() for p in str(args.kv_placement).split(",") if p.strip()]
    bad = [p for p in placements if p not in PLACEMENT_NAMES]
    if not placements or bad:
        raise HiSparseConfigError(
            f"--kv-placement={args.kv_placement!r}: use hisparse, gpu or hisparse,gpu"
        )
    _refuse_duplicates("--kv-placement", args.kv_placement, placements)
    if str(args.topk_overlap).lower() in ("off", "none", "model"):
        overlap = None
    else:
        try:
            overlap = float(args.topk_overlap)
        except ValueError:
            overlap = -1.0
        if not 0.0 <= overlap <= 1.0:
            raise HiSparseConfigError(
                f"--topk-overlap={args.topk_overlap!r}: give a fraction in [0, 1] (e.g. 0.8) "
                "or 'off'"
            )
    if args.input_len < 1:
        raise HiSparseConfigError(f"--input-len={args.input_len} must be >= 1")
    if args.output_len < 2:
        raise HiSparseConfigError(
            f"--output-len={args.output_len} must be >= 2 (time per output token needs two)"
        )
    check_gib("--gpu-memory-gib", args.gpu_memory_gib)
    if args.offload is None:  # the JSON's settings name the policy the run used
        args.offload = default_offload()
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_output_path(flag, Path(path))
    max_len = (
        args.max_model_len if args.max_model_len is not None else args.input_len + args.output_len
    )
    if max_len < args.input_len + args.output_len:
        raise HiSparseConfigError(
            f"--max-model-len={max_len} is below input + output = "
            f"{args.input_len + args.output_len}"
        )
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise HiSparseConfigError(
            f"--model={args.model!r}: no config.json there; pass a DSA checkpoint folder "
            "(e.g. one written by hisparse.models.tiny.make_tiny)"
        )
    batched = args.max_batched_tokens
    if batched is None:
        batched = 16384 if args.prefill == "synthetic" else 2048
    return dict(
        concurrency=conc, placements=placements, overlap=overlap, max_len=max_len, batched=batched
    )


def _refuse_duplicates(flag: str, text: object, values: list[Any]) -> None:
    """Each listed value is one run: a repeated one would run (and report) the same cell twice."""
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise HiSparseConfigError(
                f"{flag}={text!r}: {v} is listed more than once; list each value once"
            )
        seen.add(v)


def _check_output_path(flag: str, path: Path) -> None:
    """Refuse an output path the run could not write at its end (its results would be lost):
    a folder, or a file under something that is not a folder."""
    if path.is_dir():
        raise HiSparseConfigError(f"{flag}={str(path)!r} is a folder; give a file name in it")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise HiSparseConfigError(
            f"{flag}={str(path)!r}: {str(parent)!r} is a file, so nothing can be written under it"
        )


# -- one run ---------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(
    steps: list[dict[str, float]],
    outs: list[Any],
    wall: float,
    synthetic: bool,
) -> dict[str, Any]:
    """One table row from a finished `generate` (its outputs and ``LLM.last_run_stats``):
    throughput, latency, swap counters."""
    dec = [s for s in steps if s["decode"]]
    dec_s = sum(s["seconds"] for s in dec)
    pre = [s for s in steps if not s["decode"]]
    dec_tokens = sum(s["tokens"] for s in dec)
    hits = sum(o.metrics.hits for o in outs)
    misses = sum(o.metrics.misses for o in outs)
    nbytes = sum(o.metrics.bytes_swapped for o in outs)
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    peak = max((int(s["running"]) for s in dec), default=0)
    # Requests holding KV at once: a prefill step counts every admitted request (decoding and
    # prefilling), the capacity `hisparse plan` promises; ``peak`` counts decoding ones only,
    # which stays lower when requests finish before the last ones are prefilled.
    held = max((int(s["running"]) for s in steps), default=0)
    # Steady state: decode steps with every admitted request running. The whole-run rate
    # above also counts steps that wait on other requests' (synthetic) prefill work and the
    # ramp while requests are admitted one by one.
    at_peak = [s["tokens"] / s["seconds"] for s in dec if s["running"] == peak and s["seconds"] > 0]
    row: dict[str, Any] = dict(
        requests=len(outs),
        completed=sum(o.ok and len(o.token_ids) > 0 for o in outs),
        errors=[o.error for o in outs if o.error],
        preemptions=sum(o.metrics.preemptions for o in outs),
        peak_running=peak,
        peak_admitted=held,
        decode_steps=len(dec),
        decode_seconds=dec_s,
        decode_tok_s=dec_tokens / dec_s if dec_s > 0 else 0.0,
        peak_decode_tok_s=_percentile(at_peak, 0.5),
        peak_steps=len(at_peak),
        decode_step_ms_p50=_percentile([1e3 * s["seconds"] for s in dec], 0.5),
        decode_step_ms_p95=_percentile([1e3 * s["seconds"] for s in dec], 0.95),
        wall_seconds=wall,
        prefill_seconds=None if synthetic else sum(s["seconds"] for s in pre),
        prefill_tokens=sum(s["tokens"] for s in pre),
        ttft_p50=None if synthetic else _percentile(ttft, 0.5),
        ttft_p95=None if synthetic else _percentile(ttft, 0.95),
        tpot_p50=_percentile(tpot, 0.5),
        tpot_p95=_percentile(tpot, 0.95),
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        bytes_swapped=nbytes,
        h2d_gb_s=nbytes / dec_s / 1e9 if dec_s > 0 else 0.0,
    )
    if dec and "resolve_ms" in dec[0]:
        res = sum(s.get("resolve_ms", 0.0) for s in dec)
        gat = sum(s.get("gather_ms", 0.0) for s in dec)
        row.update(
            resolve_ms_per_step=res / len(dec),
            gather_ms_per_step=gat / len(dec),
            gather_gb_s=nbytes / (gat / 1e3) / 1e9 if gat > 0 else None,
        )
    return row


def _make_llm(args: argparse.Namespace, cfg: dict[str, Any], placement: str) -> Any:
    from hisparse.bench.hooks import BenchHooks
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM

    hs = HiSparseConfig(
        top_k=args.top_k,
        device_buffer_size=args.hot_buffer,
        host_pool_gib=args.host_pool_gib,  # None: the engine's default, sized to the run
        block_size=args.block_size,
        offload=args.offload,
    )
    return LLM(
        args.model,
        kv_placement=placement,
        hisparse=hs,
        max_num_seqs=max(cfg["concurrency"]),
        max_model_len=cfg["max_len"],
        gpu_memory_gib=args.gpu_memory_gib,
        dtype=args.dtype,
        device=args.device,
        kv_format=args.kv_format,
        max_num_batched_tokens=cfg["batched"],
        step_hooks=BenchHooks(
            topk_overlap=cfg["overlap"],
            synthetic_prefill=args.prefill == "synthetic",
            timing=args.timing,
            seed=args.seed,
        ),
        schedule=args.schedule,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _warmup_args(
    args: argparse.Namespace, top_k: int, batched: int | None = None
) -> argparse.Namespace:
    """A short run of the same shape class: 2 top_k + 1 prompt tokens, 3 new tokens. With the
    real prefill, a prompt of one whole chunk (``batched`` tokens) so the prefill kernels
    compile for the chunk's shapes outside the timing (Triton specializes on sizes: the
    short prompt alone left the first timed chunk paying for compilation)."""
    short = min(args.input_len, 2 * top_k + 1)
    if batched is not None and args.prefill == "model":
        short = min(args.input_len, max(short, batched))
    return argparse.Namespace(**{**vars(args), "input_len": short, "output_len": 3})


def warmup_batches(llm: Any, n: int) -> list[int]:
    """Batch sizes to warm before a cell of ``n`` requests: every padded decode-graph size up
    to ``n``'s (requests ramp up and drain through the smaller ones), else just ``n``.

    A decode step of a size not yet seen captures a graph (and compiles kernel variants),
    which takes seconds against a step's milliseconds: inside a timed run it dominated the
    whole-run rate. Under
    ``offload="under_pressure"`` the short warm-up requests keep their pages, so each size
    captures both kinds of step (`DecodeGraphs.run`), and a timed step that demotes replays."""
    graphs = getattr(llm.runner, "graphs", None)
    if graphs is None or not graphs.capture:
        return [n]
    top = graphs.padded_size(n)
    return [b for b in graphs.sizes if b < top] + [n]


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_cell(
    llm: Any,
    args: argparse.Namespace,
    n: int,
    seed: int,
    on_finish: Any = None,
) -> dict[str, Any]:
    """``n`` requests at once through ``llm`` (its scheduler capped at ``n`` running)."""
    from hisparse.engine.sampling import SamplingParams

    llm.set_max_num_seqs(n)
    prompts = _prompts(n, args.input_len, llm.model.config.vocab_size, seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    demoted = llm.scheduler.demotions
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, on_finish=on_finish)
    steps = llm.last_run_stats  # every step of this call (step_stats keeps only the latest)
    row = summarize(steps, outs, time.perf_counter() - t0, args.prefill == "synthetic")
    row["token_ids"] = [o.token_ids for o in outs]
    # the first request id of the cell: the top-k replay is keyed by it (`hisparse simulate`)
    row["first_request_id"] = min(int(o.request_id) for o in outs) if outs else None
    # the host pool the engine sized (its default depends on this machine's memory): what a
    # replay of this run (`hisparse simulate --compare`) must plan with
    pool = llm.kv.layout.host_pool_bytes if llm.kv.hisparse else 0
    row["host_pool_gib"] = pool / 2**30 if pool else None
    if llm.kv.hisparse:  # `HiSparseConfig.offload` and the requests it demoted in this run
        row["offload"] = llm.kv.config.offload
        row["demotions"] = llm.scheduler.demotions - demoted
    # the step-by-step schedule: tokens are comparable across placements only under the same one
    row["schedule"] = [(bool(s["decode"]), int(s["tokens"]), int(s["running"])) for s in steps]
    # every step's kind, batch and time, for reading where a whole run's time went
    row["step_log"] = [
        [int(s["decode"]), int(s["running"]), round(1e3 * s["seconds"], 3)] for s in steps
    ]
    return row


def _prefill_rate(
    llm: Any, row: dict[str, Any], args: argparse.Namespace, cfg: dict[str, Any], rates: dict
) -> dict[str, Any]:
    """Prompt tokens per second of the prefill steps and their FLOPs over the bf16 GEMM rate
    measured on the model's own shapes (`hisparse.bench.prefill_rate`), once per engine."""
    from hisparse.bench.prefill_rate import measured_gemm_rate, prefill_flops

    secs = row["prefill_seconds"]
    if not secs:
        return {}
    if "gemm" not in rates:
        rates["gemm"] = measured_gemm_rate(llm.model, min(cfg["batched"], args.input_len))
    flops = row["requests"] * prefill_flops(llm.model, args.input_len, llm.config.top_k)
    rate = rates["gemm"]
    return dict(
        prefill_tok_s=row["prefill_tokens"] / secs,
        prefill_tflop_s=flops / secs / 1e12,
        gemm_tflop_s=None if rate is None else rate / 1e12,
        prefill_mfu=None if rate is None else flops / secs / rate,
    )


# -- the command -----------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    cfg = parse_args_checked(args)
    console = Console(width=max(Console().width, 200), highlight=False)
    synthetic = args.prefill == "synthetic"
    overlap = cfg["overlap"]
    console.print(
        f"[bold]hisparse bench[/]: {args.model}, input {args.input_len:,} + output "
        f"{args.output_len:,} tokens, concurrency {cfg['concurrency']}, GPU KV budget "
        f"{args.gpu_memory_gib} GiB\n  top-k: "
        + ("the model's indexer" if overlap is None else f"replayed, step overlap {overlap}")
        + ", prefill: "
        + ("synthetic (KV rows written directly; TTFT NOT measured)" if synthetic else "model")
    )
    results: list[dict[str, Any]] = []
    total = sum(cfg["concurrency"]) * len(cfg["placements"])
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("requests", total=total)
        for placement in cfg["placements"]:
            progress.update(task, description=f"{PLACEMENT_NAMES[placement]}: loading")
            llm = _make_llm(args, cfg, placement)
            rates: dict[str, float | None] = {}
            try:
                for n in cfg["concurrency"]:
                    progress.update(task, description=f"{PLACEMENT_NAMES[placement]} x{n}")
                    base = progress.tasks[0].completed
                    if not args.no_warmup:
                        # Compile and capture outside the timing: one short cell per decode
                        # graph size the run can meet (Triton specializes kernels on sizes)
                        warm = _warmup_args(args, llm.config.top_k, cfg["batched"])
                        for b in warmup_batches(llm, n):
                            progress.update(
                                task,
                                description=f"{PLACEMENT_NAMES[placement]} x{n}: warm-up x{b}",
                            )
                            run_cell(llm, warm, b, args.seed + 999)
                        progress.update(task, description=f"{PLACEMENT_NAMES[placement]} x{n}")

                    def tick(done: int, _tot: int, base: float = base) -> None:
                        progress.update(task, completed=base + done)

                    row = run_cell(llm, args, n, args.seed, tick)
                    row.update(placement=placement, concurrency=n)
                    if not synthetic:
                        row.update(_prefill_rate(llm, row, args, cfg, rates))
                    results.append(row)
                    progress.update(task, completed=base + n)
            finally:
                llm.close()
    console.print(results_table(results, synthetic))
    ratios = ratio_rows(results)
    if ratios:
        console.print(ratio_table(ratios))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = dict(
            settings={
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k != "handler"
            },
            ttft_measured=not synthetic,
            results=[
                {k: v for k, v in r.items() if k not in ("token_ids", "schedule")} for r in results
            ],
            ratios=ratios,
        )
        args.json.write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        console.print(write_plot(results, args.plot))
    return 0


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def results_table(results: list[dict[str, Any]], synthetic: bool) -> Table:
    title = "Decode benchmark" + (" (TTFT not measured: synthetic prefill)" if synthetic else "")
    t = Table(title=title, title_justify="left")
    cols = [
        "placement",
        "conc.",
        "done",
        "peak held",
        "peak running",
        "decode tok/s",
        "tok/s at peak",
        "step p50/p95 ms",
        "TTFT p50/p95 s",
        "TPOT p50/p95 ms",
        "hit rate",
        "swapped GB",
        "H2D GB/s",
        "resolve/gather ms",
    ]
    if not synthetic:
        cols += ["prefill tok/s", "prefill TFLOP/s (GEMM)", "MFU"]
    for c in cols:
        t.add_column(c, justify="left" if c == "placement" else "right")
    for r in results:
        ttft = "n/a" if synthetic else f"{_fmt(r['ttft_p50'], 1, 2)}/{_fmt(r['ttft_p95'], 1, 2)}"
        timing = (
            f"{r['resolve_ms_per_step']:.2f}/{r['gather_ms_per_step']:.2f}"
            if "resolve_ms_per_step" in r
            else "-"
        )
        prefill = (
            []
            if synthetic
            else [
                _fmt(r.get("prefill_tok_s"), 1, 0),
                f"{_fmt(r.get('prefill_tflop_s'))} ({_fmt(r.get('gemm_tflop_s'))})",
                "-" if r.get("prefill_mfu") is None else f"{100 * r['prefill_mfu']:.0f}%",
            ]
        )
        label = PLACEMENT_NAMES[r["placement"]]
        if r.get("offload") == "always":
            label += " (offload always)"
        elif r.get("offload") == "under_pressure":
            label += f" ({r.get('demotions', 0)} demoted)"
        t.add_row(
            label,
            str(r["concurrency"]),
            f"{r['completed']}/{r['requests']}",
            str(r.get("peak_admitted", "-")),
            str(r["peak_running"]),
            _fmt(r["decode_tok_s"]),
            _fmt(r.get("peak_decode_tok_s")),
            f"{_fmt(r['decode_step_ms_p50'], 1, 1)}/{_fmt(r['decode_step_ms_p95'], 1, 1)}",
            ttft,
            f"{_fmt(r['tpot_p50'], 1e3, 2)}/{_fmt(r['tpot_p95'], 1e3, 2)}",
            "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%",
            f"{r['bytes_swapped'] / 1e9:.3f}",
            f"{r['h2d_gb_s']:.2f}",
            timing,
            *prefill,
        )
    return t


def ratio_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """HiSparse / all-GPU per concurrency (where both ran)."""
    by = {(r["placement"], r["concurrency"]): r for r in results}
    out = []
    for (p, n), hs in sorted(by.items(), key=lambda kv: kv[0][1]):
        gpu = by.get(("gpu", n))
        if p != "hisparse" or gpu is None:
            continue

        def ratio(key: str, hs: dict = hs, gpu: dict = gpu) -> float | None:
            a, b = hs.get(key), gpu.get(key)
            return None if a is None or not b else a / b

        out.append(
            dict(
                concurrency=n,
                peak_running=ratio("peak_running"),
                decode_tok_s=ratio("decode_tok_s"),
                peak_decode_tok_s=ratio("peak_decode_tok_s"),
                tpot_p50=ratio("tpot_p50"),
                tpot_p95=ratio("tpot_p95"),
                # comparable only under the same schedule (every step's batch): other batch
                # sizes may round differently (bf16 GEMMs), which is not a placement difference
                same_tokens=hs["token_ids"] == gpu["token_ids"]
                if hs.get("schedule") == gpu.get("schedule")
                else None,
            )
        )
    return out


def ratio_table(ratios: list[dict[str, Any]]) -> Table:
    t = Table(title="HiSparse / all-GPU", title_justify="left")
    cols = ("conc.", "peak running", "decode tok/s", "tok/s at peak", "TPOT p50", "TPOT p95")
    for c in (*cols, "same tokens"):
        t.add_column(c, justify="right")
    for r in ratios:
        t.add_row(
            str(r["concurrency"]),
            *(
                _fmt(r[k], 1, 2) + "x" if r[k] is not None else "-"
                for k in (
                    "peak_running",
                    "decode_tok_s",
                    "peak_decode_tok_s",
                    "tpot_p50",
                    "tpot_p95",
                )
            ),
            {True: "yes", False: "NO"}.get(r["same_tokens"], "n/a (other batches)"),
        )
    return t


def write_plot(results: list[dict[str, Any]], path: Path) -> str:
    """PNG against concurrency per placement: decode tok/s (steady state solid, whole run
    dashed), decode step p50 and peak running requests."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); skipped {path}"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for placement in PLACEMENT_NAMES:
        rows = sorted(
            (r for r in results if r["placement"] == placement), key=lambda r: r["concurrency"]
        )
        if not rows:
            continue
        x = [r["concurrency"] for r in rows]
        label = PLACEMENT_NAMES[placement]
        line = axes[0].plot(
            x, [r.get("peak_decode_tok_s") or 0 for r in rows], marker="o", label=label
        )[0]
        axes[0].plot(
            x, [r["decode_tok_s"] for r in rows], ls="--", color=line.get_color(),
            label=f"{label}, whole run",
        )  # fmt: skip
        axes[1].plot(x, [r["decode_step_ms_p50"] or 0 for r in rows], marker="o", label=label)
        axes[2].plot(x, [r["peak_running"] for r in rows], marker="o", label=label)
    titles = ("decode tok/s (steady state)", "decode step p50 (ms)", "peak running requests")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests submitted)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def plot_from(json_paths: list[Path], path: Path) -> str:
    """Redraw the plot from the JSON of one or more runs (e.g. one run per concurrency)."""
    results = [r for p in json_paths for r in json.loads(p.read_text())["results"]]
    return write_plot(results, path)
