"""``hisparse plan`` for DeepSeek-V4 (`hisparse.kv.v4_plan`): bytes per request by group at
128K, 512K and 1M tokens in each layout, and the requests that fit one GPU's KV budget or, with
``--tensor-parallel-size``, each GPU of a node after its weights.

The "HiSparse (design)" column is the design's layout (docs/design.md §20.1), on the compact
rows; "HiSparse, engine today" what the engine's HiSparse placement allocates (§20.2: the
design's GPU side, its host pool keyed by token row); the engine's all-GPU placement allocates
the ``engine`` layout (a row per token and layer), not the compact one. All are labelled so in
the output.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from hisparse.config import HiSparseConfigError, check_gib
from hisparse.kv.layout import format_gib
from hisparse.kv.v4_plan import (
    GROUPS,
    request_bytes,
    requests_that_fit,
    totals,
    weight_bytes_per_rank,
)
from hisparse.models.v4_config import CSA, HCA, SLIDING, V4Config

#: Request lengths every V4 plan shows (those up to --max-model-len).
V4_LENGTHS = (131072, 524288, 1048576)
#: Column titles of the three layouts (`hisparse.kv.v4_plan.V4_PLACEMENTS`).
TITLES = {
    "engine": "all-GPU, engine today",
    "gpu": "all-GPU, compact",
    "hisparse": "HiSparse (design)",
    "hisparse-engine": "HiSparse, engine today",
}
#: The layouts with a host pool.
HOST_LAYOUTS = ("hisparse", "hisparse-engine")
#: Row dtype of the engine's V4 pools on a GPU (the model dtype, bf16).
VALUE_BYTES = 2


def run_v4_plan(args: argparse.Namespace, config: V4Config) -> int:
    """Print the V4 plan of ``args`` (the ``hisparse plan`` namespace) for ``config``."""
    check_gib("--gpu-memory-gib", args.gpu_memory_gib)
    if args.host_pool_gib is not None:
        check_gib("--host-pool-gib", args.host_pool_gib)
    if args.data_parallel_size is not None:
        raise HiSparseConfigError(
            "--data-parallel-size: DeepSeek-V4 has no data-parallel attention yet; use "
            "--tensor-parallel-size N or one GPU"
        )
    max_len = args.max_model_len or config.max_position_embeddings
    if max_len < 1:
        raise HiSparseConfigError(f"--max-model-len={max_len} must be >= 1.")
    lengths = [n for n in V4_LENGTHS if n <= max_len]
    if args.context_len is not None:
        if not 0 < args.context_len <= max_len:
            raise HiSparseConfigError(
                f"--context-len={args.context_len} must be between 1 and --max-model-len={max_len}."
            )
        lengths = sorted({*lengths, args.context_len})
    lengths = lengths or [max_len]
    top_k = args.top_k if args.top_k is not None else config.index_topk
    buffer = args.device_buffer_size if args.device_buffer_size is not None else 2 * top_k
    if top_k < 1 or buffer < top_k:
        raise HiSparseConfigError(
            f"--device-buffer-size={buffer} must be >= --top-k={top_k} (>= 1): the hot buffer "
            "holds at least one step's selected entries"
        )
    tp = args.tensor_parallel_size or 1
    if tp < 1:
        raise HiSparseConfigError(f"--tensor-parallel-size {tp}: must be a positive integer")
    console = Console(width=max(Console().width, 100), highlight=False)
    kinds = config.layer_types
    console.print(
        f"[bold]{args.model}[/bold] (DeepSeek-V4): {len(kinds)} layers: {kinds.count(CSA)} "
        f"compressed sparse (1 entry / {config.compress_rates.get(CSA)} tokens, top-k {top_k}), "
        f"{kinds.count(HCA)} heavily compressed (1 / {config.compress_rates.get(HCA)}), "
        f"{kinds.count(SLIDING)} window only; window {config.sliding_window} rows of "
        f"{config.head_dim}, indexer keys of {config.index_head_dim}\n"
        f"  rows in bf16 (the engine's V4 row dtype); hot buffer {buffer} entries per request "
        "and compressed sparse layer"
    )
    console.print(
        "  all-GPU, engine today: what LLM(kv_placement='gpu') allocates (a row per token and "
        "layer: window row and entry columns);\n  all-GPU, compact: a window ring and entry "
        "pools (vLLM's and SGLang's layout; not built here);\n  HiSparse (design): docs/"
        "design.md §20.1, on the compact rows;\n  HiSparse, engine today: what "
        "LLM(kv_placement='hisparse') allocates (the GPU side as the design; the CSA entries "
        "keyed by token row in the host pool: §20.2; one GPU only, the engine refuses it "
        "under tensor parallelism)"
    )
    plans = {n: _groups(config, n, args.block_size, buffer) for n in lengths}
    for n, by_p in plans.items():
        console.print(_bytes_table(n, by_p))
    if tp > 1 or args.tensor_parallel_size is not None:
        params, weights = weight_bytes_per_rank(config, tp)
        per_gpu = int(args.gpu_memory_gib * args.gpu_memory_utilization * 2**30)
        budget = per_gpu - weights
        console.print(
            f"[bold]Node[/bold]: {tp} GPU(s) of {args.gpu_memory_gib:g} GiB x "
            f"{args.gpu_memory_utilization:g}; weights {params / 1e9:,.1f}B parameters, "
            f"{format_gib(weights)} on the widest rank (estimate: routed experts 4-bit, other "
            "linears fp8, as the engine holds the release; which of the release's smaller "
            "linears ship fp8 is assumed)\n"
            f"  KV budget per GPU: {format_gib(max(budget, 0))}; every rank holds every "
            "request's rows whole (heads are split, rows are not)"
        )
        if budget <= 0:
            raise HiSparseConfigError(
                f"the weights ({format_gib(weights)} per rank) do not fit {args.gpu_memory_gib:g} "
                f"GiB x {args.gpu_memory_utilization:g}: use more GPUs (--tensor-parallel-size)"
            )
    else:
        budget = int(args.gpu_memory_gib * 2**30)
        console.print(f"[bold]One GPU[/bold]: KV budget {format_gib(budget)} (--gpu-memory-gib)")
    host = int(args.host_pool_gib * 2**30) if args.host_pool_gib is not None else None
    console.print(_capacity_table(plans, budget, host))
    return 0


def _groups(config: V4Config, n: int, block_size: int, buffer: int) -> dict[str, list]:
    """Each layout's groups of one request of ``n`` tokens."""
    return {
        p: request_bytes(
            config, n, p, value_bytes=VALUE_BYTES, block_size=block_size, device_buffer_size=buffer
        )
        for p in TITLES
    }


def _bytes_table(n: int, by_p: dict[str, list]) -> Table:
    table = Table(title=f"Bytes of one {_k(n)}-token request by group (GPU / host pool)")
    table.add_column("group")
    for title in TITLES.values():
        table.add_column(title, justify="right")
    for i, name in enumerate(GROUPS):
        table.add_row(name, *(_cell(by_p[p][i].gpu, by_p[p][i].host) for p in TITLES))
    table.add_row("[bold]total[/bold]", *(_cell(*totals(by_p[p])) for p in TITLES))
    return table


def _capacity_table(plans: dict[int, dict[str, list]], budget: int, host: int | None) -> Table:
    title = "Requests that fit the GPU KV budget" + (
        " and the host pool (--host-pool-gib)" if host is not None else ""
    )
    table = Table(title=title)
    table.add_column("request length", justify="right")
    for name in TITLES.values():
        table.add_column(name, justify="right")
    table.add_column("HiSparse (design) / compact", justify="right")
    table.add_column("host pool for HiSparse's requests (design / engine)", justify="right")
    for n, by_p in plans.items():
        fit = {p: requests_that_fit(by_p[p], budget, host if p in HOST_LAYOUTS else None)
               for p in TITLES}  # fmt: skip
        ratio = f"{fit['hisparse'] / fit['gpu']:.2f}x" if fit["gpu"] else "-"
        need = " / ".join(format_gib(fit[p] * totals(by_p[p])[1]) for p in HOST_LAYOUTS)
        table.add_row(_k(n), *(f"{fit[p]:,}" for p in TITLES), ratio, need)
    return table


def _cell(gpu: int, host: int) -> str:
    if not gpu and not host:
        return "-"
    return format_gib(gpu) + (f" / {format_gib(host)}" if host else "")


def _k(n: int) -> str:
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"
