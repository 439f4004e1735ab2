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
* **Quantized layers** keep the scales of their slice: fp8 (`Fp8Linear`) the 128 x 128 tiles
  it touches, as `DsaSharder` does for DeepSeek-V3.2; 4-bit experts (`Fp4Linear`) their rows,
  or their columns in whole 32-value blocks.

The loader shards its meta skeleton here (`shard_v4`) and reads each rank's slices (the
returned splits) straight from the checkpoint: no rank holds the whole model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hisparse.parallel.shard import DsaSharder, Split, _reduce_output, _skip_lm_head

#: values of a 4-bit expert row per UE8M0 scale
_FP4_GROUP = 32


def v4_dims(config: Any) -> dict[str, int]:
    """The widths `shard_v4` splits (`check_tensor_parallel_size`)."""
    return {
        "attention heads": config.num_attention_heads,
        "output groups (o_groups)": config.o_groups,
        "expert width (moe_intermediate_size)": config.moe_intermediate_size,
    }


def _linear(sh: DsaSharder, lin: nn.Module, prefix: str, dim: int) -> None:
    """Column (``dim`` 0) or row (``dim`` 1) split of a plain, fp8 or 4-bit linear layer."""
    from hisparse.models.v4_quant import Fp4Linear

    if not isinstance(lin, Fp4Linear):
        sh.linear(lin, prefix, dim)
        return
    size = lin.in_features if dim else lin.out_features
    start, per = sh._even(size, prefix + "weight")
    if dim == 0:
        sh._keep(lin, "weight", prefix, 0, start, per)
        sh._keep(lin, "weight_scale_inv", prefix, 0, start, per)
        lin.out_features = per
        return
    if start % _FP4_GROUP or per % _FP4_GROUP:
        raise ValueError(
            f"{prefix}weight: tensor parallelism over {sh.world} ranks gives each rank "
            f"{per} input columns of a 4-bit expert; they must be whole groups of "
            f"{_FP4_GROUP} (one scale each)"
        )
    sh._keep(lin, "weight", prefix, 1, start // 2, per // 2)
    sh._keep(lin, "weight_scale_inv", prefix, 1, start // _FP4_GROUP, per // _FP4_GROUP)
    lin.in_features = per


def shard_v4(model: nn.Module, tp: Any) -> dict[str, Split]:
    """Shard `DeepseekV4ForCausalLM` (the loader's meta skeleton) to this rank in place: its
    parameters narrowed, all-reduce hooks on the row-parallel outputs. Returns what each kept
    parameter is of the checkpoint's tensor (``name -> (dim, start, length)``; absent: whole)."""
    from hisparse.models.deepseek_v4 import Block

    sh = DsaSharder(tp.rank, tp.world_size, tp)
    for i, block in enumerate(model.layers):
        assert isinstance(block, Block)
        attn, pre = block.attn, f"layers.{i}."
        _linear(sh, attn.wq_b, pre + "attn.wq_b.", 0)
        start, per = sh._even(attn.n_heads, pre + "attn.attn_sink")
        sh._keep(attn, "attn_sink", pre + "attn.", 0, start, per)
        _linear(sh, attn.wo_a, pre + "attn.wo_a.", 0)  # rows grouped by output group
        _linear(sh, attn.wo_b, pre + "attn.wo_b.", 1)
        attn.n_heads //= sh.world
        attn.groups //= sh.world
        _reduce_output(attn.wo_b, tp)
        experts = [(f"experts.{e}.", x) for e, x in enumerate(block.ffn.experts)]
        for name, expert in [*experts, ("shared_experts.", block.ffn.shared_experts)]:
            _linear(sh, expert.w1, f"{pre}ffn.{name}w1.", 0)
            _linear(sh, expert.w3, f"{pre}ffn.{name}w3.", 0)
            _linear(sh, expert.w2, f"{pre}ffn.{name}w2.", 1)
        _reduce_output(block.ffn, tp)
    if tp.rank != 0:
        _skip_lm_head(model)
    return sh.splits
