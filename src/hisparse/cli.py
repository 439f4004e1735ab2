"""``hisparse`` command line.

``hisparse plan`` shows how a model's KV cache would be laid out and how many requests of a
given length fit, with HiSparse and with every row on the GPU, before anything is allocated.
``hisparse generate`` answers a prompt (default: the bundled SmolLM2 demo) with the KV cache in
the host pool; see `hisparse.cli_generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

import hisparse.cli_env  # noqa: F401 - first: it sets OpenMP's wait policy before torch loads
from hisparse.bench.cli import add_bench_parser
from hisparse.cli_chat import add_chat_parser
from hisparse.cli_generate import add_generate_parser
from hisparse.cli_make_tiny import add_make_tiny_parser
from hisparse.cli_options import (
    add_model_option,
    add_option,
    add_options,
    add_version,
    flag_for_field,
    typed_flag,
)
from hisparse.cli_serve import add_serve_parser
from hisparse.config import (
    ROW_ALIGNMENT_BYTES,
    HiSparseConfig,
    HiSparseConfigError,
    check_gib,
)
from hisparse.defaults import DEFAULT_GPU_MEMORY_UTILIZATION
from hisparse.kv.cache_shapes import (
    SUPPORTED_KV_FORMATS,
    ModelCacheShape,
    load_model_cache_shape,
    with_mtp_layer,
)
from hisparse.kv.layer_names import summarize_index_groups
from hisparse.kv.layout import KVLayout, format_gib
from hisparse.kv.planner import plan_kv_layout
from hisparse.kv.v4_plan import V4_PRESETS, v4_config_of
from hisparse.models.source import model_context, require_dsa, resolve_model_source
from hisparse.sim.cli import add_simulate_parser

#: Exit status for bad arguments or configuration (argparse uses the same).
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hisparse",
        description="Hierarchical sparse attention: KV cache in pinned host memory, "
        "a small LRU hot buffer per request on the GPU.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_chat_parser(sub)
    add_make_tiny_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hisparse`` script; returns the process exit status.

    Under ``torchrun`` with ``--tensor-parallel-size N > 1`` only rank 0 runs the command;
    the other processes serve the engines it builds (`hisparse.parallel.group`)."""
    args = build_parser().parse_args(argv)
    sizes = (getattr(args, "tensor_parallel_size", 1), getattr(args, "data_parallel_size", 1))
    if getattr(args, "builds_engine", False) and max(sizes) > 1:
        _serve_rank_if_torchrun_worker(args)
    try:
        return args.handler(args)
    except (HiSparseConfigError, ValueError, OSError) as err:
        print(f"hisparse {args.command}: error: {flag_message(err, args)}", file=sys.stderr)
        return EXIT_USAGE


def _serve_rank_if_torchrun_worker(args: argparse.Namespace) -> None:
    """A torchrun process of rank > 0: serve rank 0's engines (never returns); its own
    output is silenced (rank 0 prints)."""
    from hisparse.parallel.group import torchrun_env

    env = torchrun_env()
    if env is None or env["rank"] == 0 or env["world_size"] < 2:
        return
    from hisparse.engine.device import checked_device
    from hisparse.engine.tp_follower import serve_torchrun_ranks

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
    serve_torchrun_ranks(checked_device(args.device))


def flag_message(err: Exception, args: argparse.Namespace) -> str:
    """The error in the flag's terms where it is about a value a flag gave (the API checks
    name the field: ``SamplingParams.max_tokens``; `hisparse.cli_options` maps fields to
    flags, as the user typed them)."""
    flag = flag_for_field(args, getattr(err, "field", None))
    if flag is None or getattr(err, "requirement", None) is None:
        return str(err)
    text = f"{flag} {err.value}: must be {err.requirement}"  # type: ignore[attr-defined]
    example = getattr(err, "example", None)
    return text + (f", e.g. {flag} {example}." if example is not None else ".")


# -- plan -------------------------------------------------------------------------------------


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="show the KV layout and how many requests fit",
        description="Plan host and GPU KV pools for a model and compare request capacity "
        "with HiSparse against keeping every KV row on the GPU. Give the KV budget "
        "(--gpu-memory-gib, as generate and serve take it) or each GPU's whole memory "
        "(--gpu-total-gib: the weights per rank are planned and taken off it).",
    )
    add_model_option(plan, what=f"; DSA models only, and the DeepSeek-V4 presets "
                     f"{', '.join(V4_PRESETS)}")  # fmt: skip
    # one of the two is needed; checked in `_run_plan` to say which values to give
    budget = plan.add_mutually_exclusive_group()
    add_option(
        budget, "--gpu-memory-gib", help="GPU memory for the KV cache, GiB, per GPU (required: "
        "this or --gpu-total-gib)",
    )  # fmt: skip
    budget.add_argument(
        "--gpu-total-gib",
        type=float,
        default=None,
        help="each GPU's whole memory, GiB: plans the weights per rank (fp8 block-scaled) and "
        "gives the KV cache what --gpu-memory-utilization of it leaves (required: this or "
        "--gpu-memory-gib)",
    )
    add_option(
        plan, "--gpu-memory-utilization", help="with --gpu-total-gib: the fraction of each "
        f"GPU's memory weights and KV may take (default: {DEFAULT_GPU_MEMORY_UTILIZATION}; the "
        "rest for activations, CUDA and NCCL)",
    )  # fmt: skip
    add_option(
        plan, "--host-pool-gib", help="pinned host pool size, GiB (default: what the requests "
        "that fit the GPUs need)",
    )  # fmt: skip
    add_option(plan, "--max-model-len")
    plan.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="plan one node of this many GPUs of --gpu-total-gib: weights per rank (fp8 "
        "block-scaled), the KV budget left per GPU, requests that fit, host RAM for one shared "
        "copy (default: none: one GPU's KV budget, --gpu-memory-gib)",
    )
    plan.add_argument(
        "--data-parallel-size",
        type=int,
        help="plan one node of this many GPUs of --gpu-total-gib with data-parallel attention "
        "(each rank its own requests, KV and host pool) beside tensor parallelism over them, "
        "for max_query_len 1-4 (default: none)",
    )
    plan.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --data-parallel-size: split the routed experts over the ranks (whole "
        "experts each)",
    )
    plan.add_argument(
        "--kv-format",
        choices=SUPPORTED_KV_FORMATS,
        default=SUPPORTED_KV_FORMATS[0],
        help="row format of sparse MLA layers (default: %(default)s)",
    )
    add_options(plan, "--sparse-top-k", "--hot-buffer-rows", "--block-size")
    plan.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens verified per step (speculative decoding): max_query_len = K + 1, "
        "so the hot buffer defaults to (K + 2) * top_k rows (default: 0)",
    )
    plan.add_argument(
        "--speculative-method",
        choices=("ngram", "mtp"),
        default="ngram",
        help="what drafts the tokens: ngram (prompt lookup) or mtp (the checkpoint's "
        "multi-token-prediction layer, whose KV rows and indexer keys each request then holds "
        "as one more layer's) (default: %(default)s)",
    )
    plan.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each host block also keeps its page's indexer keys for the prefix cache, as "
        "the engine does on one GPU and per data-parallel rank (off under tensor "
        "parallelism) (default: on)",
    )
    plan.add_argument(
        "--context-len",
        type=int,
        help="request length for the capacity figures (default: --max-model-len)",
    )
    add_option(plan, "--max-num-batched-tokens")
    plan.set_defaults(
        handler=_run_plan, flags={"HiSparseConfig.max_query_len": "--num-speculative-tokens"}
    )


def _query_len(args: argparse.Namespace) -> int:
    """Rows one request brings to a decode step: its token and its drafts."""
    k = args.num_speculative_tokens
    if k < 0:
        raise HiSparseConfigError(f"--num-speculative-tokens {k}: must be >= 0, e.g. 4.")
    return 1 + k


@dataclasses.dataclass
class _PlanInputs:
    """``hisparse plan``'s flags, checked together (every missing or bad one at once)."""

    model: ModelCacheShape
    #: what the plan modules take for the model: a canonical preset name or a config.json
    ref: str
    max_len: int
    context_len: int
    utilization: float
    #: a node plan (`--gpu-total-gib`, `--tensor-parallel-size`, `--data-parallel-size`)
    node: bool


def _plan_inputs(args: argparse.Namespace) -> _PlanInputs:
    src = resolve_model_source(args.model, name="--model")
    require_dsa(src, "plan")
    problems = []
    context = model_context(src)
    given = (("--tensor-parallel-size", args.tensor_parallel_size),
             ("--data-parallel-size", args.data_parallel_size))  # fmt: skip
    sizes = [(f, n) for f, n in given if n is not None]
    node = bool(sizes) or args.gpu_total_gib is not None
    if sizes and args.gpu_memory_gib is not None:
        problems.append(
            f"--gpu-memory-gib is the KV budget (as in generate and serve); with {sizes[0][0]} "
            "give each GPU's whole memory instead, e.g. --gpu-total-gib 141, and the weights per "
            "rank are planned"
        )
    utilization = args.gpu_memory_utilization
    if utilization is not None and args.gpu_total_gib is None:
        problems.append(
            f"--gpu-memory-utilization {utilization}: applies to --gpu-total-gib (a GPU's whole "
            "memory); --gpu-memory-gib is already the KV budget"
        )
    utilization = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    if not 0 < utilization <= 1:
        problems.append(f"--gpu-memory-utilization {utilization}: must be in (0, 1], e.g. 0.9")
    max_len = args.max_model_len if args.max_model_len is not None else context
    flag = typed_flag(args, "--max-model-len")
    if max_len is None:
        problems.append(f"{args.model}: its config.json has no max_position_embeddings; give "
                        f"{flag}, e.g. {flag} 131072")  # fmt: skip
    elif max_len < 2:
        problems.append(f"{flag} {max_len}: must be at least 2, e.g. {flag} 131072")
    elif context is not None and max_len > context:
        problems.append(
            f"{flag} {max_len:,}: the model's context is {context:,} tokens "
            f"(max_position_embeddings); give at most {flag} {context}"
        )
    context_len = args.context_len if args.context_len is not None else max_len
    if max_len is not None and context_len is not None and not 0 < context_len <= max_len:
        problems.append(
            f"--context-len={context_len} must be between 1 and --max-model-len={max_len}"
        )
    batched = args.max_num_batched_tokens
    if batched < 1:
        problems.append(
            f"{typed_flag(args, '--max-num-batched-tokens')} {batched}: must be >= 1, e.g. 2048"
        )
    for name, gib in (("--gpu-memory-gib", args.gpu_memory_gib),
                      ("--gpu-total-gib", args.gpu_total_gib),
                      ("--host-pool-gib", args.host_pool_gib)):  # fmt: skip
        if gib is not None:
            try:
                check_gib(name, gib)
            except HiSparseConfigError as err:
                problems.append(str(err).rstrip("."))
    if problems:
        raise HiSparseConfigError("; ".join(problems) + ".")
    model = load_model_cache_shape(
        str(src.config_json or src.name), block_size=args.block_size, kv_format=args.kv_format
    )
    if args.speculative_method == "mtp":
        model = with_mtp_layer(model, src.config_json, args.num_speculative_tokens)
    _check_row_alignment(model, args)
    ref = str(src.config_json or src.name)
    return _PlanInputs(model, ref, max_len, context_len, utilization, node)  # type: ignore[arg-type]


def _run_plan(args: argparse.Namespace) -> int:
    if args.gpu_memory_gib is None and args.gpu_total_gib is None:
        raise HiSparseConfigError(
            "give one GPU's KV budget (--gpu-memory-gib, e.g. 60) or each GPU's whole memory "
            "(--gpu-total-gib, e.g. 141 for an H200, with --tensor-parallel-size 8 for a node)"
        )
    v4 = v4_config_of(args.model)
    if v4 is not None:  # DeepSeek-V4: its own groups (`hisparse.cli_plan_v4`)
        from hisparse.cli_plan_v4 import run_v4_plan

        args.top_k, args.device_buffer_size = args.sparse_top_k, args.hot_buffer_rows
        if args.gpu_total_gib is not None:  # the V4 plan reads a node's GPUs from here
            args.gpu_memory_gib = args.gpu_total_gib
            args.tensor_parallel_size = args.tensor_parallel_size or 1
        elif args.tensor_parallel_size is not None:
            raise HiSparseConfigError(
                "--gpu-memory-gib is the KV budget; with --tensor-parallel-size give each GPU's "
                "whole memory instead, e.g. --gpu-total-gib 141"
            )
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        return run_v4_plan(args, v4)
    inputs = _plan_inputs(args)
    if inputs.node:
        # the node plans (`hisparse.cli_plan_node`) read the checked values from ``args``
        args.model, args.max_model_len = inputs.ref, inputs.max_len
        args.gpu_memory_gib, args.gpu_memory_utilization = args.gpu_total_gib, inputs.utilization
        if args.tensor_parallel_size is None and args.data_parallel_size is None:
            args.tensor_parallel_size = 1
        return _run_plan_node(args)
    model, max_len, context_len = inputs.model, inputs.max_len, inputs.context_len
    config = HiSparseConfig(
        top_k=args.sparse_top_k,
        device_buffer_size=args.hot_buffer_rows,
        host_pool_gib=args.host_pool_gib,
        block_size=args.block_size,
        max_query_len=_query_len(args),
    ).resolve(model.index_topk)
    budget = int(args.gpu_memory_gib * 2**30)
    if config.host_pool_bytes is None:
        config = _host_pool_for_fits(model, config, budget, max_len, context_len, args)
    hisparse = plan_kv_layout(
        model.specs,
        config,
        budget,
        max_len,
        "hisparse",
        max_num_batched_tokens=args.max_num_batched_tokens,
        host_indexer_copy=args.enable_prefix_caching,
    )
    all_gpu = plan_kv_layout(model.specs, config, budget, max_len, "gpu", check_capacity=False)

    console = Console(width=max(Console().width, 100), highlight=False)
    sparse, indexers = model.sparse_specs, model.indexer_specs
    console.print(
        f"[bold]{model.name}[/bold]: {model.num_layers} layers, {len(indexers)} with their own "
        f"indexer\n  rows: {args.kv_format} {sparse[0].row_bytes} B, indexer "
        f"{indexers[0].row_bytes} B"
    )
    console.print(
        f"HiSparse: top_k {config.top_k}, device_buffer_size {config.device_buffer_size} "
        f"({config.hot_blocks_per_request} blocks per hot group)\n"
        f"  block_size {config.block_size}, max_model_len {max_len:,}"
    )
    console.print(
        f"[bold]Host pool[/bold] (pinned): {hisparse.host_num_blocks:,} blocks x "
        f"{hisparse.host_block_bytes:,} B = {format_gib(hisparse.host_pool_bytes)}\n"
        f"  index groups: {summarize_index_groups(hisparse.index_groups)}, token-major inside"
    )
    console.print(
        f"[bold]GPU pool[/bold]: {hisparse.gpu_num_blocks:,} blocks x "
        f"{hisparse.gpu_bytes_per_block:,} B = {format_gib(hisparse.gpu_pool_bytes)}\n"
        "  block 0 is the null block; the groups below overlay each other in a block\n"
        f"  prefill staging (outside the pool): {hisparse.staging_blocks:,} pages of one layer "
        f"= {format_gib(hisparse.staging_bytes)}"
    )
    console.print(hisparse.groups_table(context_len))
    console.print(_capacity_table(hisparse, all_gpu, context_len))
    with_hisparse = hisparse.max_requests(context_len)
    baseline = all_gpu.max_requests(context_len)
    if baseline:
        verdict = f"{with_hisparse / baseline:.2f}x the requests of all-GPU"
    else:
        verdict = "all-GPU cannot hold even one request of this length"
    console.print(
        f"Requests of {context_len:,} tokens: HiSparse {with_hisparse:,}, all-GPU {baseline:,} "
        f"-> {verdict}"
    )
    bound = byte_bound(hisparse, all_gpu, context_len)
    reached = f" (reached: {with_hisparse / baseline / bound:.0%})" if baseline else ""
    console.print(f"Byte bound: all-GPU bytes / HiSparse bytes per request = {bound:.2f}x{reached}")
    return 0


def byte_bound(hisparse: KVLayout, all_gpu: KVLayout, context_len: int) -> float:
    """The capacity ratio no block layout can beat: the bytes one all-GPU request's pages
    take over the bytes one HiSparse request's pages take (block padding not counted)."""
    return (
        all_gpu.gpu_bytes_per_request(context_len)[0]
        / hisparse.gpu_bytes_per_request(context_len)[0]
    )


def _host_pool_for_fits(
    model: ModelCacheShape,
    config: Any,
    budget: int,
    max_len: int,
    context_len: int,
    args: argparse.Namespace,
) -> Any:
    """``config`` with a host pool that holds the requests of ``context_len`` the GPU side
    fits (the GPU side planned first with a host pool of one request)."""
    from hisparse.cli_plan_node import host_block_bytes

    block = host_block_bytes(model, args.block_size, args.enable_prefix_caching)
    probe = dataclasses.replace(config, host_pool_bytes=config.min_host_blocks(max_len) * block)
    gpu_side = plan_kv_layout(
        model.specs, probe, budget, max_len, "hisparse",
        max_num_batched_tokens=args.max_num_batched_tokens,
        host_indexer_copy=args.enable_prefix_caching,
    )  # fmt: skip
    fits = gpu_side.max_requests_gpu(context_len)
    host_blocks = fits * gpu_side.host_blocks_per_request(context_len) + 1
    return dataclasses.replace(
        config, host_pool_bytes=max(host_blocks * block, probe.host_pool_bytes or 0)
    )


def _run_plan_node(args: argparse.Namespace) -> int:
    """One node of ``--tensor-parallel-size`` GPUs of ``--gpu-total-gib`` each: weights per
    rank, the KV budget left per GPU, the requests that fit with HiSparse and all-GPU, and
    the host RAM that holds them once (`hisparse.parallel.plan`); with
    ``--data-parallel-size`` the data-parallel node beside it (`hisparse.cli_plan_node`)."""
    from hisparse.cli_plan_node import node_plan, run_plan_data_parallel, weights_table
    from hisparse.parallel.plan import dsa_config_of, weight_format_of

    if args.tensor_parallel_size is not None and args.data_parallel_size is not None:
        raise HiSparseConfigError(
            "--data-parallel-size is not combined with --tensor-parallel-size yet: pass one "
            "(the data-parallel table shows tensor parallelism over the same GPUs beside it)"
        )
    if args.enable_expert_parallel and args.data_parallel_size is None:
        raise HiSparseConfigError("--enable-expert-parallel needs --data-parallel-size N")
    tp = args.tensor_parallel_size or args.data_parallel_size
    flag = "--tensor-parallel-size" if args.data_parallel_size is None else "--data-parallel-size"
    if tp < 1:
        raise HiSparseConfigError(f"{flag} {tp}: must be a positive integer")
    if args.gpu_memory_gib is None:  # (`_run_plan` put --gpu-total-gib here)
        raise HiSparseConfigError(f"{flag} plans whole GPUs: give their memory, e.g. "
                                  "--gpu-total-gib 141")  # fmt: skip
    max_len = args.max_model_len
    context_len = args.context_len if args.context_len is not None else max_len
    if not 0 < context_len <= max_len:
        raise HiSparseConfigError(
            f"--context-len={context_len} must be between 1 and --max-model-len={max_len}."
        )
    model = load_model_cache_shape(args.model, block_size=args.block_size, kv_format=args.kv_format)
    _check_row_alignment(model, args)
    cfg = dsa_config_of(args.model)
    indivisible = next(
        (f"tensor parallelism over {tp} ranks does not divide the model's {size} {what}"
         for what, size in (("attention heads", cfg.num_attention_heads),
                            ("expert width (moe_intermediate_size)", cfg.moe_intermediate_size),
                            ("dense MLP width (intermediate_size)", cfg.intermediate_size))
         if size % tp),
        None,
    )  # fmt: skip
    fmt = weight_format_of(args.model)
    if args.data_parallel_size is not None:
        return run_plan_data_parallel(args, model, cfg, fmt, max_len, context_len, indivisible)
    if indivisible:
        raise HiSparseConfigError(f"--tensor-parallel-size {tp}: {indivisible}")
    node, parts = node_plan(args, model, cfg, fmt, ranks=tp, data_parallel=False,
                            max_query_len=_query_len(args), max_len=max_len,
                            context_len=context_len)  # fmt: skip
    weights, budget, hisparse, all_gpu = node.weights, node.budget, node.hisparse, node.all_gpu

    console = Console(width=max(Console().width, 100), highlight=False)
    params = sum(p.params for p in parts)
    console.print(
        f"[bold]{model.name}[/bold] on {tp} GPUs of {args.gpu_memory_gib:g} GiB: "
        f"{params / 1e9:,.1f}B parameters, {fmt.describe()}"
    )
    console.print(weights_table(parts, f"tensor parallel {tp}", weights))
    console.print(
        f"KV budget per GPU: {args.gpu_memory_utilization:.0%} of {args.gpu_memory_gib:g} GiB "
        f"- {format_gib(weights)} weights = [bold]{format_gib(budget)}[/bold]; every rank holds "
        "every request's latent rows and indexer keys (one latent head, the same on all ranks)"
    )
    console.print(_capacity_table(hisparse, all_gpu, context_len))
    with_hisparse = hisparse.max_requests(context_len)
    baseline = all_gpu.max_requests(context_len)
    verdict = (
        f"{with_hisparse / baseline:.2f}x the requests of all-GPU"
        if baseline
        else "all-GPU cannot hold even one request of this length"
    )
    console.print(
        f"Requests of {context_len:,} tokens on the node: HiSparse {with_hisparse:,}, all-GPU "
        f"{baseline:,} -> {verdict}"
    )
    console.print(
        f"Host RAM (pinned): [bold]{format_gib(hisparse.host_pool_bytes)}[/bold] for the node, "
        f"one copy shared by its {tp} ranks ({hisparse.host_num_blocks:,} blocks x "
        f"{hisparse.host_block_bytes:,} B); a pool per rank would take "
        f"{format_gib(tp * hisparse.host_pool_bytes)}"
    )
    return 0


def _check_row_alignment(model: ModelCacheShape, args: argparse.Namespace) -> None:
    """HiSparse copies KV rows with 16-byte accesses. When the ``--kv-format`` asked for gives
    rows that are not a multiple of 16 bytes but another format's rows are, name that option:
    the planner's own message (`check_row_bytes`) can only suggest padding the row, which a
    model's row format leaves no room for."""
    row = model.sparse_specs[0].row_bytes if model.sparse_specs else 0
    if row % ROW_ALIGNMENT_BYTES == 0:
        return
    for fmt in SUPPORTED_KV_FORMATS:
        if fmt == args.kv_format:
            continue
        try:
            other = load_model_cache_shape(args.model, block_size=args.block_size, kv_format=fmt)
        except HiSparseConfigError:
            continue  # e.g. fp8_ds_mla needs kv_lora_rank to be a multiple of 128
        other_row = other.sparse_specs[0].row_bytes
        if other_row % ROW_ALIGNMENT_BYTES == 0:
            raise HiSparseConfigError(
                f"{model.name}: a {args.kv_format} KV row is {row} bytes, but HiSparse copies "
                f"rows with {ROW_ALIGNMENT_BYTES}-byte accesses, so a row must be a multiple of "
                f"{ROW_ALIGNMENT_BYTES} bytes; pass --kv-format {fmt} (rows of {other_row} bytes)."
            )


def _capacity_table(hisparse: KVLayout, all_gpu: KVLayout, context_len: int) -> Table:
    table = Table(title=f"Capacity at {context_len:,} tokens per request", title_justify="left")
    for column in (
        "placement",
        "GPU blocks/req",
        "host blocks/req",
        "GPU fits",
        "host fits",
        "max requests",
    ):
        table.add_column(column, justify="left" if column == "placement" else "right")
    for name, layout in (("HiSparse", hisparse), ("all-GPU", all_gpu)):
        host = layout.max_requests_host(context_len)
        table.add_row(
            name,
            f"{layout.gpu_blocks_per_request(context_len):,}",
            f"{layout.host_blocks_per_request(context_len):,}" if host is not None else "-",
            f"{layout.max_requests_gpu(context_len):,}",
            f"{host:,}" if host is not None else "-",
            f"[bold]{layout.max_requests(context_len):,}[/bold]",
        )
    return table
