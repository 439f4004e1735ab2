"""Tensor parallelism of DeepSeek-V4 (docs/design.md §20): a rank keeps its query heads and
their output groups, and its slice of every expert.

* **Attention**: ``wq_b`` and the sinks by head (column-parallel), ``wo_a`` by output group
  (each group's rows are its heads' projection), ``wo_b`` on the groups' columns
  (row-parallel, all-reduce). The shared K = V head, the compressors, the indexer and every
  cached row are whole: each rank writes the same rows and picks the same entries.
* **MoE**: every routed expert and the shared one: ``w1`` / ``w3`` column-parallel, ``w2``
  row-parallel; one all-reduce per MoE block. The router (and its hash table) is whole.
* **Hyper-connections, norms, embedding and head** are whole; ranks other than 0 skip the
  head (rank 0 samples).

The loader shards the meta skeleton here (`shard_v4`), then reads each rank's slices of the
split tensors straight from the checkpoint (`split_dim`): no rank holds the whole model.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from hisparse.parallel.shard import (
    _part,
    _reduce_output,
    _skip_lm_head,
    shard_column,
    shard_row,
)
from hisparse.validation import HiSparseConfigError

#: the tensors `shard_v4` splits, and along which dim (the rest is whole on every rank)
_SPLITS = (
    (re.compile(r"(^|\.)attn\.(wq_b|wo_a)\.weight$"), 0),
    (re.compile(r"(^|\.)attn\.attn_sink$"), 0),
    (re.compile(r"(^|\.)attn\.wo_b\.weight$"), 1),
    (re.compile(r"(^|\.)(experts\.\d+|shared_experts)\.(w1|w3)\.weight$"), 0),
    (re.compile(r"(^|\.)(experts\.\d+|shared_experts)\.w2\.weight$"), 1),
)


def split_dim(name: str) -> int | None:
    """The dim along which rank ``r`` of ``w`` keeps the ``r``-th of ``w`` equal parts of
    parameter ``name`` (`shard_v4`); None: whole."""
    for pattern, dim in _SPLITS:
        if pattern.search(name):
            return dim
    return None


def v4_dims(config: Any) -> dict[str, int]:
    """The widths `shard_v4` splits (`check_tensor_parallel_size`)."""
    return {
        "attention heads": config.num_attention_heads,
        "output groups (o_groups)": config.o_groups,
        "expert width (moe_intermediate_size)": config.moe_intermediate_size,
    }


def shard_v4(model: nn.Module, tp: Any) -> nn.Module:
    """`DeepseekV4ForCausalLM` (the loader's meta skeleton, or a loaded model) -> this rank's
    shard, in place: its parameters narrowed as `split_dim` says, all-reduce hooks on the
    row-parallel outputs."""
    from hisparse.models.deepseek_v4 import Block

    rank, world = tp.rank, tp.world_size
    if any(type(m).__name__ in ("Fp8Linear", "Fp4Linear") for m in model.modules()):
        raise HiSparseConfigError(
            "LLM.tensor_parallel_size: DeepSeek-V4's fp8 and 4-bit layers are not sharded yet; "
            "run a quantized DeepSeek-V4 checkpoint with tensor_parallel_size=1.",
            field="LLM.tensor_parallel_size",
            value=world,
        )
    for block in model.layers:
        assert isinstance(block, Block)
        attn = block.attn
        shard_column(attn.wq_b, rank, world)
        attn.attn_sink = nn.Parameter(_part(attn.attn_sink.data, 0, rank, world),
                                      requires_grad=False)  # fmt: skip
        shard_column(attn.wo_a, rank, world)  # rows grouped by output group
        shard_row(attn.wo_b, rank, world)
        attn.n_heads //= world
        attn.groups //= world
        _reduce_output(attn.wo_b, tp)
        for expert in [*block.ffn.experts, block.ffn.shared_experts]:
            shard_column(expert.w1, rank, world)
            shard_column(expert.w3, rank, world)
            shard_row(expert.w2, rank, world)
        _reduce_output(block.ffn, tp)
    if rank != 0:
        _skip_lm_head(model)
    return model
