"""Shard a model over the ranks of a tensor-parallel engine (docs/design.md §18).

A DSA rank shards the meta skeleton the per-rank loader builds (`shard_dsa`: the shapes it
keeps and each slice's place in the checkpoint, which the loader then reads, §18.8); a GGUF
model loads whole on the CPU and keeps its slices (`shard_llama`). Each rank computes its part;
a forward hook all-reduces the output of each row-parallel piece (`TPGroup.all_reduce`). What
is sharded and what is whole:

* **MLA** (DeepSeek-V3.2, GLM-5): ``q_b_proj`` and ``kv_b_proj`` by head (column-parallel),
  ``o_proj`` by head on its input (row-parallel, all-reduce; a bias stays on rank 0). The
  q and kv down-projections, their norms, the latent row and the lightning indexer are whole:
  every rank writes the same latent rows and picks the same top-k.
* **GQA** (Llama, SmolLM2): ``v_proj`` by KV head, ``o_proj`` row-parallel; the rows a rank
  caches hold its KV heads only. ``q_proj`` and ``k_proj`` stay whole because the training-free
  indexer scores every query head against every KV head's key (its key cache is replicated,
  like DSA's indexer); attention then uses this rank's query heads and keys.
* **MLP** (dense layers, every routed expert, the shared experts): gate and up column-parallel,
  down row-parallel; one all-reduce per MLP or MoE block (the experts' partial sums and the
  shared expert's are added first). Router weights stay whole.
* **Embedding and LM head**: DSA models split them by vocabulary (`models.vocab_parallel`:
  the embedding all-reduces its rows, the logits are gathered on rank 0, which samples); GQA
  models keep both whole on every rank and the other ranks skip the LM head.
* **fp8 weights** (`Fp8Linear`, `Fp8Experts`) keep the 128 x 128 scale tiles their slice
  touches (`DsaSharder`).

`check_tensor_parallel_size` refuses a rank count that does not divide the heads (and the MLP
widths) before anything loads.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hisparse.validation import HiSparseConfigError

# -- what must divide ------------------------------------------------------------------------


def model_dims(path: Path, gguf: bool) -> dict[str, int]:
    """The widths tensor parallelism splits, read from the checkpoint's config only: the
    attention heads (and KV heads of a GQA model) and the MLP widths."""
    if gguf:
        meta = read_gguf_scalars(
            path,
            ("llama.attention.head_count", "llama.attention.head_count_kv",
             "llama.feed_forward_length"),
        )  # fmt: skip
        heads = int(meta["llama.attention.head_count"])
        return {
            "attention heads": heads,
            "KV heads": int(meta.get("llama.attention.head_count_kv", heads)),
            "MLP width (feed_forward_length)": int(meta["llama.feed_forward_length"]),
        }
    from hisparse.models.registry import is_v4

    if is_v4(path):
        from hisparse.models.v4_config import V4Config
        from hisparse.parallel.shard_v4 import v4_dims

        return v4_dims(V4Config.from_pretrained(path))
    from hisparse.models.dsa_config import DsaConfig

    cfg = DsaConfig.from_pretrained(path)
    dims = {"attention heads": cfg.num_attention_heads}
    if "dense" in cfg.mlp_layer_types:
        dims["dense MLP width (intermediate_size)"] = cfg.intermediate_size
    if "sparse" in cfg.mlp_layer_types:
        dims["expert width (moe_intermediate_size)"] = cfg.moe_intermediate_size
    return dims


def check_tensor_parallel_size(path: Path, gguf: bool, tp: int) -> None:
    """A `HiSparseConfigError` (a ValueError) naming the width and the rank count when
    ``tp`` ranks cannot split the model evenly; reads the config, loads no weights."""
    for what, size in model_dims(path, gguf).items():
        if size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise HiSparseConfigError(
                f"LLM.tensor_parallel_size={tp} does not divide the model's {size} {what}: "
                f"every rank must hold the same number; use one of "
                f"{', '.join(map(str, divisors))}.",
                field="LLM.tensor_parallel_size",
                value=tp,
            )


def check_before_ranks(
    path: Path, gguf: bool, hs: Any, indexer: str, max_model_len: int | None,
    pool: tuple[str, str, Any, Any, bool, Any] | None = None,
) -> None:  # fmt: skip
    """The checks one rank makes while it loads the model, made from the checkpoint's config
    alone (no weights), so that a parallel engine raises them on the driver before any rank
    starts, with the error type and text of one rank: the HiSparse settings resolved against
    the model (`HiSparseConfig.resolve`), a GQA indexer's ``top_k`` against its sink and
    window, ``max_model_len`` against the model's context limit, and for a DSA model under
    HiSparse with a given ``host_pool_gib`` the host pool against one ``max_model_len``
    request (``pool``: the engine's ``(kv_placement, kv_format, dtype, device,
    prefix_caching, speculative_config)``; its rows' formats come from config.json, an MTP
    proposer's layer among them)."""
    from hisparse.models.registry import DEFAULT_GQA_TOP_K, indexer_method, is_v4
    from hisparse.validation import check_max_model_len

    if gguf:
        from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig

        config = hs.resolve(model_top_k=DEFAULT_GQA_TOP_K)
        GqaIndexerConfig(top_k=config.top_k, method=indexer_method(indexer))
        meta = read_gguf_scalars(path, ("llama.context_length",))
        if "llama.context_length" in meta:
            check_max_model_len(max_model_len, int(meta["llama.context_length"]))
        return
    if is_v4(path):
        return  # its loader resolves its own settings (`_load_v4`)
    from hisparse.models.dsa_config import DsaConfig

    cfg = DsaConfig.from_pretrained(path)
    config = hs.resolve(model_top_k=cfg.index_topk)
    check_max_model_len(max_model_len, cfg.max_position_embeddings)
    if pool is not None and pool[0] == "hisparse" and config.host_pool_bytes is not None:
        from hisparse.kv.planner import check_host_pool, host_pool_block_bytes
        from hisparse.models.registry import dsa_row_format, dsa_specs

        _, kv_format, dtype, device, prefix, spec = pool
        row = dsa_row_format(cfg, kv_format, dtype, device)
        mtp = int(getattr(spec, "method", None) == "mtp" and bool(cfg.num_nextn_predict_layers))
        specs = dsa_specs(cfg, row, indexer, config.block_size, mtp)
        block = host_pool_block_bytes(specs, config.block_size, prefix)
        max_len = max_model_len or cfg.max_position_embeddings
        check_host_pool(config, block, config.host_pool_bytes // block, max_len)


def read_gguf_scalars(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Scalar metadata ``keys`` of a GGUF file, read from its header without parsing the rest
    (`gguf.GGUFReader` builds every field: seconds for SmolLM2's vocabulary)."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
              11: "q", 12: "d"}  # fmt: skip
    out: dict[str, Any] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", m, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        (n_kv,) = struct.unpack_from("<Q", m, 16)
        pos = 24

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

        def skip(kind: int, pos: int) -> tuple[Any, int]:
            if kind in scalar:
                fmt = "<" + scalar[kind]
                return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
            if kind == 8:
                return string(pos)
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if elem in scalar:
                    return None, pos + count * struct.calcsize("<" + scalar[elem])
                for _ in range(count):
                    _, pos = skip(elem, pos)
                return None, pos
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            value, pos = skip(kind, pos + 4)
            if key in keys:
                out[key] = value
                if len(out) == len(keys):
                    break
    return out


# -- sharding --------------------------------------------------------------------------------

#: What a rank keeps of a tensor: ``(dim, start, length)`` of the whole tensor (``start +
#: length`` may run past the end: the vocabulary's padding rows, zero), or `ZERO` (a
#: row-parallel bias on a rank other than 0: zeros, not read).
Split = tuple[int, int, int] | None
ZERO: Split = None


def _part(t: torch.Tensor, dim: int, rank: int, world: int, groups: int | None = None):
    """Rank ``rank``'s contiguous ``1 / world`` of ``t`` along ``dim`` (``groups``: split
    ``dim`` into that many equal groups, heads say, and keep this rank's groups)."""
    size = t.shape[dim]
    groups = groups or size
    if groups % world or size % groups:
        raise ValueError(f"cannot split {size} ({groups} groups) over {world} ranks")
    per = size // world
    return t.narrow(dim, rank * per, per).contiguous()


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)`` (a new tensor; zero rows past the end; on the meta
    device only the shape changes)."""
    shape = list(t.shape)
    shape[dim] = length
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    keep = max(0, min(length, t.shape[dim] - start))
    if keep and t.device.type != "meta":
        out.narrow(dim, 0, keep).copy_(t.narrow(dim, start, keep))
    return out


def _set_weight(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shard_column(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's output rows (no bias in the models sharded here)."""
    _set_weight(linear, _part(linear.weight.data, 0, rank, world))
    if linear.bias is not None:
        linear.bias = nn.Parameter(_part(linear.bias.data, 0, rank, world), requires_grad=False)


def shard_row(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's input columns; the partial outputs add up to the whole (the bias once,
    on rank 0)."""
    _set_weight(linear, _part(linear.weight.data, 1, rank, world))
    if linear.bias is not None and rank != 0:
        linear.bias = None


def _reduce_output(module: nn.Module, tp: Any) -> None:
    """The module's output is a partial sum: all-reduce it (a forward hook)."""

    def hook(_mod: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)

    module.register_forward_hook(hook)


def shard_mlp(mlp: nn.Module, rank: int, world: int) -> None:
    shard_column(mlp.gate_proj, rank, world)
    shard_column(mlp.up_proj, rank, world)
    shard_row(mlp.down_proj, rank, world)


class DsaSharder:
    """Shards a `DsaForCausalLM` (on the meta device, as the per-rank loader builds it, or
    loaded) to rank ``rank`` of ``world`` in place and records each kept parameter's `Split`
    under its name (`splits`), which the loader reads from the checkpoint.

    fp8 weights (`Fp8Linear`, `Fp8Experts`) keep the scale tiles their slice touches: a slice
    of output rows may start inside a tile (``row_offset``); a slice of input columns must
    start on a tile boundary or lie within one tile (the kernels index scale columns from the
    slice's start), else a `ValueError` names the weight."""

    def __init__(self, rank: int, world: int, tp: Any = None) -> None:
        self.rank, self.world, self.tp = rank, world, tp
        self.splits: dict[str, Split] = {}

    def _keep(self, module: nn.Module, attr: str, prefix: str, dim: int, start: int,
              length: int) -> None:  # fmt: skip
        t = getattr(module, attr)
        setattr(module, attr, nn.Parameter(_narrow(t.data, dim, start, length),
                                           requires_grad=False))  # fmt: skip
        self.splits[prefix + attr] = (dim, start, length)

    def _even(self, size: int, what: str) -> tuple[int, int]:
        if size % self.world:
            raise ValueError(f"cannot split {what} of {size} over {self.world} ranks")
        per = size // self.world
        return self.rank * per, per

    def _scales(self, module: nn.Module, attr: str, prefix: str, dim: int, start: int,
                length: int, what: str, rows: bool) -> int:  # fmt: skip
        """Keep the scale tiles of weight elements ``[start, start + length)`` along ``dim``;
        returns the slice's offset into its first tile."""
        from hisparse.models.fp8 import BLOCK, tile_range

        off = start % BLOCK
        if not rows and off and off + length > BLOCK:
            raise ValueError(
                f"{what}: tensor parallelism over {self.world} ranks splits its {length}-wide "
                f"input slice at column {start}, inside a {BLOCK}-wide fp8 scale tile; the "
                f"fp8 GEMMs need each rank's input columns to start a tile"
            )
        first, count = tile_range(start, length)
        self._keep(module, attr, prefix, dim, first, count)
        return off

    def linear(self, lin: nn.Module, prefix: str, dim: int) -> None:
        """Column (``dim`` 0: output rows) or row (``dim`` 1: input columns) split of a plain
        or fp8 linear layer named ``prefix`` (ending in a dot)."""
        from hisparse.models.fp8_linear import Fp8Linear

        size = lin.weight.shape[dim]
        start, per = self._even(size, f"{prefix}weight")
        self._keep(lin, "weight", prefix, dim, start, per)
        if isinstance(lin, Fp8Linear):
            off = self._scales(lin, "weight_scale_inv", prefix, dim, start, per,
                               prefix + "weight", rows=dim == 0)  # fmt: skip
            if dim == 0:
                lin.row_offset = off
        lin.out_features, lin.in_features = lin.weight.shape
        if lin.bias is not None:
            if dim == 0:
                self._keep(lin, "bias", prefix, 0, start, per)
            elif self.rank != 0:
                self.splits[prefix + "bias"] = ZERO

    def mlp(self, mlp: nn.Module, prefix: str) -> None:
        self.linear(mlp.gate_proj, prefix + "gate_proj.", 0)
        self.linear(mlp.up_proj, prefix + "up_proj.", 0)
        self.linear(mlp.down_proj, prefix + "down_proj.", 1)

    def fp8_experts(self, ex: nn.Module, prefix: str) -> None:
        start, per = self._even(ex.inter, prefix + "experts (moe_intermediate_size)")
        for part in ("gate", "up"):
            self._keep(ex, f"{part}_weight", prefix, 1, start, per)
            off = self._scales(ex, f"{part}_scale", prefix, 1, start, per,
                               f"{prefix}{part} weights", rows=True)  # fmt: skip
        ex.row_offset = off
        self._keep(ex, "down_weight", prefix, 2, start, per)
        self._scales(ex, "down_scale", prefix, 2, start, per, prefix + "down weights",
                     rows=False)  # fmt: skip
        ex.inter = per

    def vocab(self, owner: nn.Module, attr: str, prefix: str, head: bool) -> None:
        """Replace ``owner.<attr>`` (an embedding or LM head) with its vocabulary-parallel form."""
        from hisparse.models.vocab_parallel import VocabParallelEmbedding, VocabParallelHead

        old = getattr(owner, attr)
        vocab, dim = old.weight.shape
        cls = VocabParallelHead if head else VocabParallelEmbedding
        with torch.device(old.weight.device):
            new = cls(vocab, dim, self.rank, self.world, self.tp)
        new.weight = nn.Parameter(_narrow(old.weight.data, 0, new.first, new.rows),
                                  requires_grad=False)  # fmt: skip
        setattr(owner, attr, new)
        self.splits[f"{prefix}{attr}.weight"] = (0, new.first, new.rows)

    def layer(self, layer: nn.Module, prefix: str) -> None:
        from hisparse.models.deepseek_v32 import MLAttention, MoE
        from hisparse.models.layers import MLP

        attn = layer.self_attn
        assert isinstance(attn, MLAttention)
        a = prefix + "self_attn."
        if attn.n_heads % self.world:
            raise ValueError(f"cannot split {attn.n_heads} heads over {self.world} ranks")
        self.linear(attn.q_b_proj, a + "q_b_proj.", 0)
        self.linear(attn.kv_b_proj, a + "kv_b_proj.", 0)
        self.linear(attn.o_proj, a + "o_proj.", 1)
        attn.n_heads //= self.world
        mlp = layer.mlp
        m = prefix + "mlp."
        if isinstance(mlp, MoE):
            if mlp.fp8_experts is not None:
                self.fp8_experts(mlp.fp8_experts, m + "fp8_experts.")
            for e, expert in enumerate(mlp.experts):
                self.mlp(expert, f"{m}experts.{e}.")
            self.mlp(mlp.shared_experts, m + "shared_experts.")
        else:
            assert isinstance(mlp, MLP)
            self.mlp(mlp, m)
        if self.tp is not None:
            _reduce_output(attn.o_proj, self.tp)
            _reduce_output(mlp, self.tp)


def shard_dsa(model: nn.Module, rank: int, world: int, tp: Any = None) -> dict[str, Split]:
    """`DsaForCausalLM` -> rank ``rank``'s shard of ``world``, in place (`DsaSharder`): heads,
    MLP and expert widths split (design §18.2), embedding and LM head vocabulary-parallel, the
    multi-token-prediction layers as the others; ``tp`` (a `TPGroup`): the all-reduce hooks
    and the collectives of the vocabulary-parallel layers. Returns every kept `Split`."""
    sh = DsaSharder(rank, world, tp)
    for i, layer in enumerate(model.model.layers):
        sh.layer(layer, f"model.layers.{i}.")
    for i, layer in enumerate(model.mtp):
        sh.layer(layer, f"mtp.{i}.")
        if layer.embed_tokens is not None:
            sh.vocab(layer, "embed_tokens", f"mtp.{i}.", head=False)
        if layer.shared_head.head is not None:
            sh.vocab(layer.shared_head, "head", f"mtp.{i}.shared_head.", head=True)
    sh.vocab(model.model, "embed_tokens", "model.", head=False)
    sh.vocab(model, "lm_head", "", head=True)
    return sh.splits


def _skip_lm_head(model: nn.Module) -> None:
    """Ranks other than 0 do not sample: their logits are empty (``[rows, 0]``)."""

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty((hidden.shape[0], 0))

    model.logits = logits  # type: ignore[method-assign]


def shard_llama(model: nn.Module, tp: Any) -> nn.Module:
    """`LlamaForCausalLM` (on the CPU, loaded whole) -> this rank's shard, in place."""
    from hisparse.models.llama import LlamaDecoderLayer
    from hisparse.models.llama_attention import LlamaAttention

    rank, world = tp.rank, tp.world_size
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn = layer.self_attn
        assert isinstance(attn, LlamaAttention)
        h, g = attn.n_heads // world, attn.n_kv // world
        shard_column(attn.v_proj, rank, world)
        shard_row(attn.o_proj, rank, world)
        attn.tp_heads = (slice(rank * h, (rank + 1) * h), slice(rank * g, (rank + 1) * g))
        attn._qkv = None  # the fused CPU decode weight, if any, held the whole projections
        _reduce_output(attn.o_proj, tp)
        shard_mlp(layer.mlp, rank, world)
        _reduce_output(layer.mlp, tp)
    # The batch-1 CPU decode step runs the layers without their modules' calls (no hooks).
    model.cpu_fast_path = False
    # Nor does its fused one-row CPU MLP: every MLP goes through its module (the all-reduce).
    model._mlp = lambda i, mlp, h: mlp(h)  # type: ignore[method-assign]
    if rank != 0:
        _skip_lm_head(model)
    return model


def shard_gqa_row_format(fmt: Any, world: int) -> Any:
    """This rank's rows: its ``1 / world`` of the KV heads."""
    from dataclasses import replace

    return replace(fmt, num_kv_heads=fmt.num_kv_heads // world)
