"""Capacity of a tensor-parallel node (``hisparse plan --tensor-parallel-size N``).

Weights per rank are counted from the architecture's dimensions (`DsaConfig`, defaults of
transformers' config classes: the real DeepSeek-V3.2 and GLM-5 shapes), sharded as
`hisparse.parallel.shard` shards them, in the releases' fp8 block-scaled format: every linear
weight of attention, indexer (``wq_b``, ``wk``), dense MLP and experts as e4m3 plus one fp32
scale per 128 x 128 tile of the rank's slice; embedding, LM head, router, the indexer's
``weights_proj`` and the norms in bf16 (the router bias fp32). For a linear of ``out x in``
split ``s`` ways along one side the rank holds ``out·in/s + 4·⌈out'/128⌉·⌈in'/128⌉`` bytes
(``out' x in'`` its slice).

Per layer, with hidden ``h``, heads ``H``, ``q_lora``, latent ``c``, RoPE ``r``, no-RoPE
``n`` and value ``v`` head dims, indexer ``Hi x d`` heads, MLP width ``I``, expert width
``Ie``, ``E`` routed and ``S`` shared experts, vocabulary ``V``:

* attention, sharded by head: ``q_b`` (q_lora x H(n+r)), ``kv_b`` (c x H(n+v)), ``o`` (Hv x h);
* attention, whole: ``q_a`` (h x q_lora), ``kv_a`` (h x (c+r)), norms ``q_lora + c``;
* indexer (layers that own one), whole: ``wq_b`` (q_lora x Hi·d), ``wk`` (h x d),
  ``weights_proj`` (h x Hi), ``k_norm`` (2d);
* dense MLP, sharded: ``3·h·I``; MoE, sharded: ``E·3·h·Ie + 3·h·Ie·S``, router ``E·h + E``;
* whole: two norms ``2h`` per layer, embedding and LM head ``V·h`` each, final norm ``h``.

Every rank holds every request's MLA latent rows and indexer keys (one latent head, the same
on every rank), so the per-GPU KV layout, and the requests it fits, are those of one GPU with
the budget each GPU has left; the node serves that many requests, and its host pool holds
them once (one shared copy per node, not one per rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def fp8_linear_bytes(out_dim: int, in_dim: int) -> int:
    """e4m3 weights plus one fp32 scale per 128 x 128 tile."""
    return out_dim * in_dim + 4 * math.ceil(out_dim / _TILE) * math.ceil(in_dim / _TILE)


def dsa_weight_parts(
    cfg: DsaConfig, tp: int, indexer_layers: int | None = None
) -> list[WeightPart]:
    """Weights of ``cfg`` on one of ``tp`` ranks, by kind. ``indexer_layers``: layers that own
    an indexer (default: ``cfg.indexer_full``)."""
    h, H, L = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    ql, c, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    hi, d = cfg.index_n_heads, cfg.index_head_dim
    dense = sum(t == "dense" for t in cfg.mlp_layer_types)
    moe = L - dense
    full = sum(cfg.indexer_full) if indexer_layers is None else indexer_layers
    E, S, Ie, inter = (
        cfg.n_routed_experts,
        cfg.n_shared_experts,
        cfg.moe_intermediate_size,
        cfg.intermediate_size,
    )

    def col(out_dim: int, in_dim: int) -> int:  # split along the outputs
        return fp8_linear_bytes(out_dim // tp, in_dim)

    def row(out_dim: int, in_dim: int) -> int:  # split along the inputs
        return fp8_linear_bytes(out_dim, in_dim // tp)

    def mlp(width: int) -> int:  # gate and up by column, down by row
        return 2 * col(width, h) + row(h, width)

    parts = [
        WeightPart(
            "attention q_b, kv_b, o (by head)",
            L * (ql * H * (n + r) + c * H * (n + v) + H * v * h),
            L * (col(H * (n + r), ql) + col(H * (n + v), c) + row(h, H * v)),
            True,
        ),
        WeightPart(
            "attention q_a, kv_a + norms (whole)",
            L * (h * ql + h * (c + r) + ql + c),
            L * (fp8_linear_bytes(ql, h) + fp8_linear_bytes(c + r, h) + 2 * (ql + c)),
            False,
        ),
        WeightPart(
            f"indexer ({full} layers, whole)",
            full * (ql * hi * d + h * d + h * hi + 2 * d),
            full * (fp8_linear_bytes(hi * d, ql) + fp8_linear_bytes(d, h) + 2 * h * hi + 4 * d),
            False,
        ),
        WeightPart(f"dense MLP ({dense} layers)", dense * 3 * h * inter, dense * mlp(inter), True),
        WeightPart(
            f"routed experts ({moe} layers x {E})", moe * E * 3 * h * Ie, moe * E * mlp(Ie), True
        ),
        WeightPart(f"shared experts ({moe} x {S})", moe * 3 * h * Ie * S, moe * mlp(Ie * S), True),
        WeightPart("router (whole)", moe * (E * h + E), moe * (2 * E * h + 4 * E), False),
        WeightPart(
            "embedding + LM head (whole)", 2 * cfg.vocab_size * h, 4 * cfg.vocab_size * h, False
        ),
        WeightPart("layer norms (whole)", (2 * L + 1) * h, 2 * (2 * L + 1) * h, False),
    ]
    return parts


def format_count(n: int) -> str:
    """``671.88B`` / ``1.7M`` parameters."""
    return f"{n / 1e9:,.2f}B" if n >= 1e8 else f"{n / 1e6:,.1f}M"


def dsa_config_of(model: str) -> DsaConfig:
    """The full architecture of a plan preset (``deepseek-v3.2``, ``glm-5``) or config.json."""
    presets = {"deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa"}
    if model in presets:
        return DsaConfig.from_dict({"model_type": presets[model]})
    return DsaConfig.from_pretrained(model)
