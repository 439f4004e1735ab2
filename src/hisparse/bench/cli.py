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
from pathlib import Path
from typing import Any

from rich.console import Console

from hisparse.bench.cell import _make_llm, _prefill_rate, _warmup_args, run_cell, warmup_batches
from hisparse.bench.report import (
    PLACEMENT_NAMES,
    ratio_rows,
    ratio_table,
    results_table,
    write_plot,
)
from hisparse.cli_generate import PARALLEL_FLAGS, add_parallel_args
from hisparse.cli_options import add_model_option, add_option, add_options
from hisparse.config import HiSparseConfigError, check_gib, default_offload
from hisparse.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hisparse.engine.speculative import SPECULATIVE_HELP, SpeculativeConfig
from hisparse.models.source import require_dsa, resolve_model_source


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
    add_model_option(bench, what="; DSA models only (the replayed top-k and the synthetic "
                     "prefill write MLA rows)")  # fmt: skip
    bench.add_argument("--input-len", type=int, required=True, help="prompt tokens per request")
    bench.add_argument("--output-len", type=int, required=True, help="new tokens per request")
    bench.add_argument(
        "--concurrency", default="1,8", help="requests per run, e.g. 1,8,64,256 (default: "
        "%(default)s)",
    )  # fmt: skip
    bench.add_argument(
        "--kv-placement", default="hisparse,gpu", help="placements to compare: hisparse, gpu "
        "or both, comma-separated (default: %(default)s)",
    )  # fmt: skip
    bench.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="every prompt starts with the same N tokens (questions over one document): "
        "prefix caching on, each cell prefilling the document once (default 0: unrelated "
        "prompts, prefix caching off)",
    )
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
    add_option(bench, "--gpu-memory-gib", required=True,
               help="GPU memory for the KV cache, GiB (required)")  # fmt: skip
    add_option(
        bench, "--host-pool-gib", help="HiSparse host pool (default: enough for the largest "
        "concurrency at --max-model-len, at most half the host memory available)",
    )  # fmt: skip
    add_option(
        bench, "--max-model-len", type=positive_int_or_default,
        help="most tokens of one request (default: input + output length)",
    )  # fmt: skip
    add_options(bench, "--hot-buffer-rows", "--sparse-top-k", "--offload")
    bench.add_argument(
        "--kv-format", default="auto", help="KV row format: auto, fp8_ds_mla, bf16 or fp32 "
        "(default: %(default)s: fp8_ds_mla where its rows align)",
    )  # fmt: skip
    add_option(bench, "--block-size")
    add_option(
        bench, "--max-num-batched-tokens", type=positive_int_or_default, default=None,
        help="prompt tokens per engine step (default: 16384 with --prefill synthetic, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} with --prefill model)",
    )  # fmt: skip
    bench.add_argument(
        "--schedule",
        choices=("mixed", "prefill-first"),
        default="mixed",
        help="mixed: decodes first, prompt chunks in the budget left; prefill-first: prompt "
        "chunks alone while any prompt is unfinished (default: %(default)s)",
    )
    add_options(bench, "--device", "--dtype")
    add_parallel_args(bench)
    bench.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)"
    )
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
    bench.add_argument(
        "--speculative-config", default=None,
        help=SPECULATIVE_HELP + "; needs --topk-overlap off --prefill model (a verify step's "
        "rows each select their own top-k), no --timing (default: none)",
    )  # fmt: skip
    bench.add_argument("--json", type=Path, default=None, help="write results here (default: none)")
    bench.add_argument(
        "--plot", type=Path, default=None, help="write a PNG plot here (default: none)"
    )
    bench.set_defaults(
        handler=run_bench,
        builds_engine=True,
        flags={
            "LLM.max_num_seqs": "--concurrency",
            **PARALLEL_FLAGS,
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
    require_dsa(resolve_model_source(args.model, name="--model"), "bench")
    spec = SpeculativeConfig.of(args.speculative_config)
    if spec is not None and (overlap is not None or args.prefill != "model" or args.timing):
        raise HiSparseConfigError(
            f"--speculative-config {args.speculative_config}: a verify step's rows each "
            "select their own top-k, which the replayed top-k, the synthetic prefill and the "
            "swap timer do not model; add --topk-overlap off --prefill model and drop --timing"
        )
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = 16384 if args.prefill == "synthetic" else DEFAULT_MAX_NUM_BATCHED_TOKENS
    return dict(
        concurrency=conc, placements=placements, overlap=overlap, max_len=max_len,
        batched=batched, spec=spec,
    )  # fmt: skip


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
