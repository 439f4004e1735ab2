"""DeepSeek-V4's configuration: what the model needs from a ``deepseek_v4`` config.json.

Defaults and legacy keys follow transformers' ``DeepseekV4Config``, so a config.json that omits a
key (or ships the release's older names: ``compress_ratios``, ``compress_rate_csa`` /
``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim``, a flat YaRN ``rope_scaling``)
means what transformers would read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hisparse.models.dsa_config import DsaConfigError, RopeConfig, _parse_rope

#: attention kinds of a layer (transformers' ``layer_types``)
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    num_experts_per_tok=6,
    n_routed_experts=256,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=1048576,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=128,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=1,
)


@dataclass(frozen=True)
class V4Config:
    """Everything `hisparse.models.deepseek_v4` reads, with transformers' defaults."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    routed_scaling_factor: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    num_nextn_predict_layers: int
    qk_rope_head_dim: int = 64
    scoring_func: str = "sqrtsoftplus"
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    #: entries per compressed window of each compressed layer type
    compress_rates: Mapping[str, int] = field(default_factory=dict)
    #: RoPE of sliding layers (``main``) and of compressed layers and their compressors
    rope_main: RopeConfig = field(default_factory=RopeConfig)
    rope_compress: RopeConfig = field(default_factory=RopeConfig)
    eos_token_id: int | list[int] | None = None

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0: a sliding-window-only layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> V4Config:
        """Parse a config.json dict (``model_type`` ``deepseek_v4``)."""
        if cfg.get("model_type") != "deepseek_v4":
            raise DsaConfigError(f"model_type {cfg.get('model_type')!r} is not deepseek_v4")
        values: dict[str, Any] = {}
        for key, default in _DEFAULTS.items():
            value = cfg.get(key)
            values[key] = default if value is None else type(default)(value)
        n = values["num_hidden_layers"]
        if values["num_attention_heads"] % values["o_groups"]:
            raise DsaConfigError("num_attention_heads must be a multiple of o_groups")
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise DsaConfigError(f"scoring_func={scoring!r}: expected one of {SCORING_FUNCS}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DsaConfigError(f"hidden_act={cfg.get('hidden_act')!r}: only 'silu' is supported")
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        if cfg.get("compress_rate_csa") is not None:
            rates[CSA] = int(cfg["compress_rate_csa"])
        if cfg.get("compress_rate_hca") is not None:
            rates[HCA] = int(cfg["compress_rate_hca"])
        types = cfg.get("layer_types")
        if types is None and cfg.get("compress_ratios") is not None:
            ratios = [int(r) for r in cfg["compress_ratios"]]
            if set(ratios) - set(_RATIO_TO_TYPE):
                raise DsaConfigError(
                    f"compress_ratios={ratios}: each layer's ratio must be one of "
                    f"{sorted(_RATIO_TO_TYPE)} (sliding only, CSA, HCA); or give layer_types"
                )
            types = [_RATIO_TO_TYPE[r] for r in ratios]
        if types is None:
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        types = list(types)[:n]
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            n_hash = cfg.get("num_hash_layers")
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        mlp = list(mlp)[:n]
        for name, got, allowed in (
            ("layer_types", types, LAYER_TYPES),
            ("mlp_layer_types", mlp, MLP_TYPES),
        ):
            if len(got) != n or set(got) - set(allowed):
                raise DsaConfigError(f"{name}={got!r}: one of {allowed} per layer ({n} layers)")
        for kind in set(types) - {SLIDING}:
            if int(rates.get(kind, 0)) < 1:
                raise DsaConfigError(f"compress_rates[{kind!r}] must be a positive integer")
        partial = cfg.get("partial_rotary_factor")
        rope_dim = cfg.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(values["head_dim"] * (partial if partial is not None else 64 / 512))
        rope_main, rope_compress = _parse_v4_rope(cfg, values)
        return cls(
            **values,
            qk_rope_head_dim=int(rope_dim),
            scoring_func=scoring,
            layer_types=tuple(types),
            mlp_layer_types=tuple(mlp),
            compress_rates={k: int(v) for k, v in rates.items()},
            rope_main=rope_main,
            rope_compress=rope_compress,
            eos_token_id=cfg.get("eos_token_id", 1),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> V4Config:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        return cls.from_dict(json.loads(p.read_text()))


def _parse_v4_rope(
    cfg: Mapping[str, Any], values: Mapping[str, Any]
) -> tuple[RopeConfig, RopeConfig]:
    """``(main, compress)``: sliding layers rotate plainly at ``rope_theta``; compressed layers
    at ``compress_rope_theta`` with the checkpoint's YaRN scaling, whose cos/sin are not
    multiplied by YaRN's attention factor (transformers forces it to 1)."""
    max_pos = values["max_position_embeddings"]
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, comp = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in (params or cfg.get("rope_scaling") or {}).items()}
        main = {"rope_type": "default", "rope_theta": values["rope_theta"]}
        comp = {**flat, "rope_theta": values["compress_rope_theta"]}
        comp.setdefault("rope_type", comp.get("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    return (
        _parse_rope({"rope_parameters": main}, max_pos),
        _parse_rope({"rope_parameters": comp}, max_pos),
    )
