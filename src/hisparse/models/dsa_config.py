"""Configuration of a DSA model (DeepSeek-V3.2 / GLM-5), read from a Hugging Face config.json.

One dataclass covers both architectures: GLM-5 (`glm_moe_dsa`) is DeepSeek-V3.2's network with
other dimensions, interleaved RoPE in the indexer, and the IndexShare schedule (some layers own
no indexer and reuse the previous full layer's top-k). Defaults are those of transformers'
config classes, so a config.json that omits a key means what transformers would read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hisparse.kv.cache_shapes import indexer_schedule

SUPPORTED_ARCHS = ("deepseek_v32", "glm_moe_dsa")

_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=64,
        first_k_dense_replace=3,
    ),
    "glm_moe_dsa": dict(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        num_attention_heads=64,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_rope_head_dim=64,
        v_head_dim=256,
        qk_nope_head_dim=192,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
        first_k_dense_replace=3,
    ),
}


class DsaConfigError(ValueError):
    """A config.json this implementation cannot run; the message names the key."""


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of the 64-dim rotary slice: plain (``default``) or YaRN-scaled."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def inv_freq_and_factor(self, dim: int) -> tuple[torch.Tensor, float]:
        """Per-pair inverse frequencies ``[dim / 2]`` and the factor that scales cos and sin."""
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        if self.rope_type == "default":
            return 1.0 / (self.theta**exponents), 1.0
        # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
        pos_freqs = self.theta**exponents
        extrapolate = 1.0 / pos_freqs
        interpolate = 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (
                dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        inv_freq = interpolate * (1 - keep) + extrapolate * keep
        factor = self.attention_factor
        if factor is None:
            if self.mscale and self.mscale_all_dim:
                factor = _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                    self.factor, self.mscale_all_dim
                )
            else:
                factor = _yarn_mscale(self.factor)
        return inv_freq, float(factor)

    def softmax_mscale(self) -> float:
        """Extra factor on the MLA softmax scale (DeepSeek YaRN: ``mscale(factor, all_dim)²``)."""
        if self.rope_type != "default" and self.mscale_all_dim:
            m = _yarn_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DsaConfig:
    """Everything the model needs from config.json, with transformers' defaults."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    first_k_dense_replace: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    #: Per layer: "dense" MLP or "sparse" (MoE).
    mlp_layer_types: tuple[str, ...] = ()
    #: Per layer: True when the layer runs its own indexer (False: IndexShare follower).
    indexer_full: tuple[bool, ...] = ()
    attention_bias: bool = False
    #: multi-token-prediction layers the release ships after the last layer (DeepSeek: 1)
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def indexer_rope_interleaved(self) -> bool:
        """GLM-5 rotates the indexer's RoPE slice in interleaved pairs; DeepSeek-V3.2 half-split."""
        return self.arch == "glm_moe_dsa"

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale()

    def index_leader(self, layer: int) -> int:
        """The layer whose indexer selects this layer's top-k."""
        while not self.indexer_full[layer]:
            layer -= 1
        return layer

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> DsaConfig:
        """Parse a config.json dict (``model_type`` deepseek_v32 or glm_moe_dsa)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise DsaConfigError(
                f"model_type {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}"
            )
        d = dict(_DEFAULTS[arch])
        values: dict[str, Any] = {}
        for key, default in d.items():
            value = cfg.get(key)
            if key == "n_routed_experts" and value is None:
                value = cfg.get("num_experts")
            values[key] = default if value is None else type(default)(value)
        if values["q_lora_rank"] is None or values["q_lora_rank"] <= 0:
            raise DsaConfigError("q_lora_rank must be set: the DSA indexer reads the q latent")
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise DsaConfigError(f"scoring_func={scoring!r}: only 'sigmoid' routing is supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise DsaConfigError(f"hidden_act={act!r}: only 'silu' is supported")
        n_layers = values["num_hidden_layers"]
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(values["first_k_dense_replace"], n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if len(mlp_types) != n_layers or set(mlp_types) - {"dense", "sparse"}:
            raise DsaConfigError(f"mlp_layer_types={mlp_types!r} must be dense/sparse per layer")
        if arch == "glm_moe_dsa":
            full = indexer_schedule(
                n_layers,
                index_topk_freq=cfg.get("index_topk_freq") or 1,
                index_skip_topk_offset=cfg.get("index_skip_topk_offset", 2),
                index_topk_pattern=cfg.get("index_topk_pattern"),
                indexer_types=cfg.get("indexer_types"),
            )
        else:
            full = [True] * n_layers
        if values["n_routed_experts"] % values["n_group"]:
            raise DsaConfigError("n_routed_experts must be a multiple of n_group")
        return cls(
            arch=arch,
            **values,
            rope=_parse_rope(cfg, values["max_position_embeddings"]),
            mlp_layer_types=tuple(mlp_types),
            indexer_full=tuple(full),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DsaConfig:
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise DsaConfigError(f"no config.json at {p}") from None


def _parse_rope(cfg: Mapping[str, Any], max_pos: int) -> RopeConfig:
    """``rope_parameters`` (transformers 5) or legacy ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "yarn":
        raise DsaConfigError(f"rope type {rope_type!r} is not supported (default, yarn)")
    orig = params.get("original_max_position_embeddings", max_pos)
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig

    def opt(key: str) -> float | None:
        v = params.get(key)
        return None if v is None else float(v)

    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
