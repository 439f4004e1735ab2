"""Capacity of a tensor-parallel node (``hisparse plan --tensor-parallel-size N``).

Weights per rank are the bytes the engine allocates on each rank (`hisparse.models.loader`):
counted from the architecture's dimensions (`DsaConfig`, defaults of transformers' config
classes: the real DeepSeek-V3.2 and GLM-5 shapes), sharded as `hisparse.parallel.shard`
shards them, in the checkpoint's format (`WeightFormat`). An fp8 checkpoint (DeepSeek's
block-scaled release format) keeps every linear weight of attention, indexer (``wq_b``,
``wk``), dense MLP and experts as e4m3 plus one fp32 scale per 128 x 128 tile its slice
touches; MLA's ``kv_b`` is dequantized to the compute dtype (the absorbed decode reads it so);
everything else is in the compute dtype (bf16 on GPUs), except the router and the indexer's
``weights_proj``, fp32. A bf16 checkpoint keeps every weight in the compute dtype. For a
linear of ``out x in`` split ``s`` ways along one side the rank holds ``out·in/s`` weights
(bytes: 1 in e4m3) and ``4·t_out·t_in`` scale bytes, ``t`` the 128-tiles its slice touches.

Per layer, with hidden ``h``, heads ``H``, ``q_lora``, latent ``c``, RoPE ``r``, no-RoPE
``n`` and value ``v`` head dims, indexer ``Hi x d`` heads, MLP width ``I``, expert width
``Ie``, ``E`` routed and ``S`` shared experts, vocabulary ``V``:

* attention, sharded by head: ``q_b`` (q_lora x H(n+r)), ``kv_b`` (c x H(n+v)), ``o`` (Hv x h);
* attention, whole: ``q_a`` (h x q_lora), ``kv_a`` (h x (c+r)), norms ``q_lora + c``;
* indexer (layers that own one), whole: ``wq_b`` (q_lora x Hi·d), ``wk`` (h x d),
  ``weights_proj`` (h x Hi, fp32), ``k_norm`` (2d);
* dense MLP, sharded: ``3·h·I``; MoE, sharded: ``E·3·h·Ie + 3·h·Ie·S``, router ``E·h + E``
  (fp32);
* vocabulary-parallel: embedding and LM head, ``ceil(V/N)·h`` each per rank;
* whole: two norms ``2h`` per layer, final norm ``h``;
* the multi-token-prediction layer(s) the release ships (``num_nextn_predict_layers``): a MoE
  layer with its indexer as above, ``enorm`` and ``hnorm`` (``2h``), ``eh_proj`` (``2h x h``,
  compute dtype) and ``shared_head``'s norm ``h``. The checkpoint also stores the layer's own
  ``embed_tokens`` and ``shared_head.head``, but DeepSeek-V3's MTP shares the embedding and
  output head with the main model (the checkpoint's are copies), so they are counted once,
  in the model's embedding + LM head.

Every rank holds every request's MLA latent rows and indexer keys (one latent head, the same
on every rank), so the per-GPU KV layout, and the requests it fits, are those of one GPU with
the budget each GPU has left; the node serves that many requests, and its host pool holds
them once (one shared copy per node, not one per rank).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hisparse.models.dsa_config import DsaConfig

#: Fraction of each GPU's memory the engine may use (vLLM's ``gpu_memory_utilization``
#: default): the rest is for activations, the CUDA context and NCCL buffers.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_TILE = 128


@dataclass(frozen=True)
class WeightPart:
    """One kind of weight: its parameters in the whole model and its bytes on one rank."""

    name: str
    params: int
    bytes_per_rank: int
    sharded: bool


@dataclass(frozen=True)
class WeightFormat:
    """How the engine holds a checkpoint's weights: fp8 block-scaled (``fp8``) or all in the
    compute dtype of ``dtype_bytes`` (2: bf16)."""

    fp8: bool = True
    dtype_bytes: int = 2

    def describe(self) -> str:
        if self.fp8:
            return (
                "fp8 block-scaled as the engine holds them (e4m3 + fp32 tile scales; kv_b, "
                "norms, vocabulary-parallel embedding and LM head in bf16; router, indexer "
                "head weights fp32)"
            )
        return "bf16 (router, indexer head weights fp32; embedding, LM head vocabulary-parallel)"


def weight_format_of(model: str) -> WeightFormat:
    """The format of a plan preset (the fp8 releases) or of a checkpoint's config.json (fp8
    where it declares DeepSeek's ``quantization_config``)."""
    if model in _PRESETS:
        return WeightFormat(fp8=True)
    p = Path(model)
    p = p / "config.json" if p.is_dir() else p
    cfg = json.loads(p.read_text())
    return WeightFormat(fp8=bool(cfg.get("quantization_config")))


def _tiles(start: int, length: int) -> int:
    """128-tiles that elements ``[start, start + length)`` touch."""
    return math.ceil((start + length) / _TILE) - start // _TILE


def fp8_linear_bytes(out_dim: int, in_dim: int) -> int:
    """e4m3 weights plus one fp32 scale per 128 x 128 tile."""
    return out_dim * in_dim + 4 * math.ceil(out_dim / _TILE) * math.ceil(in_dim / _TILE)


class _Rank:
    """Byte counts of one rank's slices (module docstring)."""

    def __init__(self, tp: int, rank: int, fmt: WeightFormat) -> None:
        self.tp, self.rank, self.fmt = tp, rank, fmt

    def linear(self, out_dim: int, in_dim: int, split: str = "", fp8: bool = True) -> int:
        """``split``: ``col`` (outputs), ``row`` (inputs) or whole; ``fp8``: kept fp8 when
        the checkpoint is (False: dequantized, as MLA's kv_b)."""
        n, k = out_dim, in_dim
        r0 = c0 = 0
        if split == "col":
            n = out_dim // self.tp
            r0 = self.rank * n
        elif split == "row":
            k = in_dim // self.tp
            c0 = self.rank * k
        if self.fmt.fp8 and fp8:
            return n * k + 4 * _tiles(r0, n) * _tiles(c0, k)
        return n * k * self.fmt.dtype_bytes

    def mlp(self, width: int, h: int) -> int:  # gate and up by column, down by row
        return 2 * self.linear(width, h, "col") + self.linear(h, width, "row")

    def vocab(self, v: int, h: int) -> int:
        return math.ceil(v / self.tp) * h * self.fmt.dtype_bytes


def dsa_weight_parts(
    cfg: DsaConfig,
    tp: int,
    indexer_layers: int | None = None,
    *,
    rank: int = 0,
    fmt: WeightFormat | None = None,
    mtp: int | None = None,
    ep: int = 1,
) -> list[WeightPart]:
    """Weights of ``cfg`` on rank ``rank`` of ``tp``, by kind (module docstring).
    ``indexer_layers``: layers that own an indexer (default: ``cfg.indexer_full``); ``mtp``:
    multi-token-prediction layers (default: ``cfg.num_nextn_predict_layers``); ``ep``: ranks
    the routed experts are split over, whole experts each (expert parallelism)."""
    fmt = fmt or WeightFormat()
    R = _Rank(tp, rank, fmt)
    b = fmt.dtype_bytes
    h, H, L = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    ql, c, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    hi, d = cfg.index_n_heads, cfg.index_head_dim
    V = cfg.vocab_size
    dense = sum(t == "dense" for t in cfg.mlp_layer_types)
    moe = L - dense
    full = sum(cfg.indexer_full) if indexer_layers is None else indexer_layers
    mtp = cfg.num_nextn_predict_layers if mtp is None else mtp
    E, S, Ie, inter = (
        cfg.n_routed_experts,
        cfg.n_shared_experts,
        cfg.moe_intermediate_size,
        cfg.intermediate_size,
    )
    by_head_p = ql * H * (n + r) + c * H * (n + v) + H * v * h
    by_head = (R.linear(H * (n + r), ql, "col") + R.linear(H * (n + v), c, "col", fp8=False)
               + R.linear(h, H * v, "row"))  # fmt: skip
    whole_p = h * ql + h * (c + r) + ql + c
    whole = R.linear(ql, h) + R.linear(c + r, h) + b * (ql + c)
    indexer_p = ql * hi * d + h * d + h * hi + 2 * d
    indexer = R.linear(hi * d, ql) + R.linear(d, h) + 4 * h * hi + b * 2 * d
    if E % ep:
        raise ValueError(f"{ep} expert-parallel ranks do not divide {E} routed experts")
    experts_p, experts = E * 3 * h * Ie, E // ep * R.mlp(Ie, h)
    shared_p, shared = 3 * h * Ie * S, R.mlp(Ie * S, h)
    router_p, router = E * h + E, 4 * (E * h + E)
    dense_b = dense * R.mlp(inter, h)
    per_rank = f", {E // ep} a rank" if ep > 1 else ""
    by_head_s, by_vocab_s = (" (by head)", " (by vocabulary)") if tp > 1 else ("", "")
    parts = [
        WeightPart(f"attention q_b, kv_b, o{by_head_s}", L * by_head_p, L * by_head, True),
        WeightPart("attention q_a, kv_a + norms (whole)", L * whole_p, L * whole, False),
        WeightPart(f"indexer ({full} layers, whole)", full * indexer_p, full * indexer, False),
        WeightPart(f"dense MLP ({dense} layers)", dense * 3 * h * inter, dense_b, True),
        WeightPart(
            f"routed experts ({moe} layers x {E}{per_rank})", moe * experts_p, moe * experts, True
        ),
        WeightPart(f"shared experts ({moe} x {S})", moe * shared_p, moe * shared, True),
        WeightPart("router (whole, fp32)", moe * router_p, moe * router, False),
        WeightPart(f"embedding + LM head{by_vocab_s}", 2 * V * h, 2 * R.vocab(V, h), True),
        WeightPart("layer norms (whole)", (2 * L + 1) * h, b * (2 * L + 1) * h, False),
    ]
    if mtp:
        # a MoE layer with its indexer, its norms, eh_proj and shared head's norm; the
        # embedding and LM head are the model's (counted above)
        extra_p = 2 * h + 2 * h * h + h
        extra = b * extra_p
        layer_p = by_head_p + whole_p + indexer_p + experts_p + shared_p + router_p + 2 * h
        layer = by_head + whole + indexer + experts + shared + router + b * 2 * h
        name = (f"multi-token prediction ({mtp} layer{'s' * (mtp > 1)}; embedding, LM head "
                "shared)")  # fmt: skip
        parts.append(WeightPart(name, mtp * (layer_p + extra_p), mtp * (layer + extra), True))
    return parts


def widest_rank_parts(
    cfg: DsaConfig, tp: int, indexer_layers: int | None = None, *, fmt: WeightFormat | None = None
) -> list[WeightPart]:
    """`dsa_weight_parts` of the rank that holds the most bytes (ranks differ only where a
    slice starts inside a scale tile, which the releases' widths never do)."""
    ranks = [dsa_weight_parts(cfg, tp, indexer_layers, rank=k, fmt=fmt) for k in range(tp)]
    return max(ranks, key=lambda parts: sum(p.bytes_per_rank for p in parts))


def format_count(n: int) -> str:
    """``671.88B`` / ``1.7M`` parameters."""
    return f"{n / 1e9:,.2f}B" if n >= 1e8 else f"{n / 1e6:,.1f}M"


_PRESETS = {"deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa"}


def dsa_config_of(model: str) -> DsaConfig:
    """The full architecture of a plan preset (``deepseek-v3.2``, ``glm-5``: the releases,
    with their multi-token-prediction layer) or of a checkpoint's config.json."""
    if model in _PRESETS:
        return DsaConfig.from_dict({"model_type": _PRESETS[model], "num_nextn_predict_layers": 1})
    return DsaConfig.from_pretrained(model)
