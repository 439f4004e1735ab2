"""``hisparse plan`` for a node of GPUs: tensor parallelism (``--tensor-parallel-size N``)
and data-parallel attention with expert parallelism (``--data-parallel-size N
--enable-expert-parallel``), whose table also shows tensor parallelism over the same GPUs.

Under tensor parallelism every rank holds every request's latent rows and indexer keys, so a
node serves what one GPU's KV budget holds, and the host pool is one copy for the node. Under
data-parallel attention each rank holds only its own requests' KV with its own host pool: a
node serves N times what one rank's budget holds, and needs N pools. The weights differ too:
a tensor-parallel rank holds ``1/N`` of every sharded weight, a data-parallel rank the whole
attention, dense MLPs, shared experts and vocabulary, but only ``1/N`` of the routed experts
(whole experts: `hisparse.parallel.plan.dsa_weight_parts` with ``ep``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.kv.layout import KVLayout, format_gib
from hisparse.kv.planner import plan_kv_layout

#: requests of this length unless --max-model-len
NODE_PLAN_LEN = 131072
#: ``max_query_len`` rows of the data-parallel table (1 + speculative tokens)
QUERY_LENS = (1, 2, 3, 4)


@dataclass(frozen=True)
class NodePlan:
    """One topology's figures: per rank, and what the node holds."""

    name: str
    max_query_len: int
    weights: int  # bytes per rank
    budget: int  # KV bytes per GPU
    hisparse: KVLayout
    all_gpu: KVLayout
    #: ranks whose requests are their own (1 under tensor parallelism: all hold the same)
    request_ranks: int
    #: host pools a node holds (1 under tensor parallelism: shared; N under data parallelism)
    host_pools: int

    def per_rank(self, context_len: int) -> tuple[int, int]:
        """Requests of ``context_len`` one rank holds: (HiSparse, all-GPU)."""
        return self.hisparse.max_requests(context_len), self.all_gpu.max_requests(context_len)

    def per_node(self, context_len: int) -> tuple[int, int]:
        h, g = self.per_rank(context_len)
        return h * self.request_ranks, g * self.request_ranks

    @property
    def host_bytes(self) -> int:
        """Pinned host memory of the node."""
        return self.hisparse.host_pool_bytes * self.host_pools


def host_block_bytes(model: Any, block_size: int, indexer_copy: bool) -> int:
    """One host block: a page of every sparse layer's rows, and with ``indexer_copy`` the
    page's indexer keys of every indexer layer (`plan_kv_layout`'s ``host_indexer_copy``)."""
    block = sum(s.row_bytes for s in model.sparse_specs) * block_size
    if indexer_copy:
        block += sum(s.row_bytes for s in model.indexer_specs) * block_size
    return block


def rank_layouts(
    model: Any, config: HiSparseConfig, budget: int, max_len: int, context_len: int,
    host_pool_bytes: int | None, max_num_seqs: int | None = None,
    host_indexer_copy: bool = False,
) -> tuple[KVLayout, KVLayout]:  # fmt: skip
    """(HiSparse, all-GPU) layouts of one GPU with ``budget`` KV bytes; the host pool is
    ``host_pool_bytes`` or sized for the requests of ``context_len`` the GPU side fits.
    ``max_num_seqs``: the engine's (it bounds the prefill staging area; default: none).
    ``host_indexer_copy``: each host block also holds its page's indexer keys (prefix
    caching under HiSparse, the engine's default on one rank and per data-parallel rank)."""
    block = host_block_bytes(model, config.block_size, host_indexer_copy)
    probe = dataclasses.replace(config, host_pool_bytes=config.min_host_blocks(max_len) * block)
    seqs: dict[str, Any] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    seqs["host_indexer_copy"] = host_indexer_copy
    if host_pool_bytes is None:
        gpu_side = plan_kv_layout(model.specs, probe, budget, max_len, "hisparse", **seqs)
        fits = gpu_side.max_requests_gpu(context_len)
        host_blocks = fits * gpu_side.host_blocks_per_request(context_len) + 1
        host_pool_bytes = max(host_blocks * block, probe.host_pool_bytes or 0)
    config = dataclasses.replace(config, host_pool_bytes=host_pool_bytes)
    hisparse = plan_kv_layout(model.specs, config, budget, max_len, "hisparse", **seqs)
    all_gpu = plan_kv_layout(model.specs, config, budget, max_len, "gpu", check_capacity=False,
                             **seqs)  # fmt: skip
    return hisparse, all_gpu


def node_plan(
    args: argparse.Namespace, model: Any, cfg: Any, fmt: Any, *, ranks: int,
    data_parallel: bool, max_query_len: int, max_len: int, context_len: int,
) -> tuple[NodePlan, list[Any]]:  # fmt: skip
    """One topology over ``ranks`` GPUs of ``args.gpu_memory_gib``; also its weight parts."""
    from hisparse.parallel.plan import dsa_weight_parts, widest_rank_parts

    indexers = len(model.indexer_specs)
    if data_parallel:
        ep = ranks if args.enable_expert_parallel else 1
        parts = dsa_weight_parts(cfg, 1, indexers, fmt=fmt, ep=ep)
        name = f"DP {ranks}" + (f" + EP {ranks}" if ep > 1 else "")
    else:
        parts = widest_rank_parts(cfg, ranks, indexer_layers=indexers, fmt=fmt)
        name = f"TP {ranks}"
    weights = sum(p.bytes_per_rank for p in parts)
    budget = int(args.gpu_memory_utilization * args.gpu_memory_gib * 2**30) - weights
    if budget <= 0:
        raise HiSparseConfigError(
            f"{model.name} ({name}): {format_gib(weights)} of weights per rank exceed "
            f"{args.gpu_memory_utilization:.0%} of {args.gpu_memory_gib} GiB; "
            + ("pass --enable-expert-parallel, " if data_parallel and ep == 1 else "")
            + "use more GPUs or --gpu-total-gib."
        )
    config = HiSparseConfig(
        top_k=args.sparse_top_k, device_buffer_size=args.hot_buffer_rows,
        block_size=args.block_size, max_query_len=max_query_len,
    ).resolve(model.index_topk)  # fmt: skip
    pool = int(args.host_pool_gib * 2**30) if args.host_pool_gib is not None else None
    # prefix caching's indexer copy: per data-parallel rank (tensor parallelism turns the
    # cache off under HiSparse: its host rows are sharded)
    copy = data_parallel and args.enable_prefix_caching
    hisparse, all_gpu = rank_layouts(model, config, budget, max_len, context_len, pool,
                                     host_indexer_copy=copy)  # fmt: skip
    n = ranks if data_parallel else 1
    plan = NodePlan(name, max_query_len, weights, budget, hisparse, all_gpu, n, n)
    return plan, parts


def weights_table(parts: list[Any], topology: str, weights: int) -> Table:
    """The weights one rank holds, part by part, under ``topology`` (e.g. "TP 8")."""
    from hisparse.parallel.plan import format_count

    table = Table(title=f"Weights per rank ({topology})", title_justify="left")
    for column in ("weights", "parameters", "per rank"):
        table.add_column(column, justify="left" if column == "weights" else "right")
    for p in parts:
        table.add_row(p.name, format_count(p.params), format_gib(p.bytes_per_rank))
    total = sum(p.params for p in parts)
    table.add_row("[bold]total[/bold]", format_count(total), f"[bold]{format_gib(weights)}[/]")
    return table


def run_plan_data_parallel(
    args: argparse.Namespace, model: Any, cfg: Any, fmt: Any, max_len: int, context_len: int,
    tp_error: str | None,
) -> int:  # fmt: skip
    """``--data-parallel-size N``: weights per rank, then per ``max_query_len`` the KV budget,
    the requests a rank and the node hold with each placement and the node's host RAM, for
    data-parallel attention and for tensor parallelism over the same GPUs."""

    dp = args.data_parallel_size
    if cfg.n_routed_experts % dp and args.enable_expert_parallel:
        raise HiSparseConfigError(
            f"--data-parallel-size {dp} does not divide the model's {cfg.n_routed_experts} "
            "routed experts (each rank holds whole experts)"
        )
    kw = dict(max_len=max_len, context_len=context_len)
    plans = []
    for q in QUERY_LENS:
        plans.append(node_plan(args, model, cfg, fmt, ranks=dp, data_parallel=True,
                               max_query_len=q, **kw)[0])  # fmt: skip
    for q in QUERY_LENS if tp_error is None else ():
        try:
            plans.append(node_plan(args, model, cfg, fmt, ranks=dp, data_parallel=False,
                                   max_query_len=q, **kw)[0])  # fmt: skip
        except HiSparseConfigError as err:  # e.g. TP 2 cannot hold the weights
            tp_error = str(err)
            break
    _, parts = node_plan(args, model, cfg, fmt, ranks=dp, data_parallel=True, max_query_len=1,
                         **kw)  # fmt: skip
    console = Console(width=max(Console().width, 140), highlight=False)
    params = sum(p.params for p in parts)
    console.print(
        f"[bold]{model.name}[/bold] on {dp} GPUs of {args.gpu_memory_gib:g} GiB: "
        f"{params / 1e9:,.1f}B parameters, {fmt.describe()}"
    )
    console.print(weights_table(parts, plans[0].name, plans[0].weights))
    console.print(capacity_table(plans, context_len))
    dp1 = plans[0]
    h_rank, g_rank = dp1.per_rank(context_len)
    h_node, g_node = dp1.per_node(context_len)
    line = (f"Requests of {context_len:,} tokens a node at max_query_len 1: {dp1.name}: "
            f"HiSparse {h_node:,} ({h_rank:,} a rank), all-GPU {g_node:,} ({g_rank:,} a "
            "rank)")  # fmt: skip
    tp1 = next((p for p in plans if p.name.startswith("TP")), None)
    if tp1 is not None:
        h_tp, g_tp = tp1.per_node(context_len)
        line += f"; {tp1.name}: HiSparse {h_tp:,}, all-GPU {g_tp:,}"
    console.print(line)
    if tp_error:
        console.print(f"TP {dp} does not fit: {tp_error}")
    console.print(
        f"Host RAM (pinned) at max_query_len 1: one pool per data-parallel rank, {dp} x "
        f"{format_gib(dp1.hisparse.host_pool_bytes)} = [bold]{format_gib(dp1.host_bytes)}[/bold]"
        f" for the node ({dp1.hisparse.host_num_blocks:,} blocks x "
        f"{dp1.hisparse.host_block_bytes:,} B a rank)"
    )
    return 0


def capacity_table(plans: list[NodePlan], context_len: int) -> Table:
    table = Table(title=f"Requests of {context_len:,} tokens per rank and per node",
                  title_justify="left")  # fmt: skip
    columns = ("topology", "query len", "hot rows", "weights", "KV/GPU", "HiSparse rank",
               "HiSparse node", "all-GPU rank", "all-GPU node", "host RAM")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "topology" else "right")
    for p in plans:
        h_rank, g_rank = p.per_rank(context_len)
        h_node, g_node = p.per_node(context_len)
        hot = p.hisparse.hot_blocks_per_request
        table.add_row(
            p.name, str(p.max_query_len), f"{hot * p.hisparse.block_size:,}",
            format_gib(p.weights), format_gib(p.budget), f"{h_rank:,}",
            f"[bold]{h_node:,}[/bold]", f"{g_rank:,}", f"{g_node:,}", format_gib(p.host_bytes),
        )  # fmt: skip
    return table
