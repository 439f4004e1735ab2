"""Small random DSA checkpoints written by transformers itself, for tests and benchmarks.

No small trained DSA model exists, so tests build one: transformers' own
``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` initializes it and ``save_pretrained``
writes it, which makes the checkpoint (names, layout, config.json) exactly what hisparse will
meet in the field, and gives the reference forward the tests compare against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("deepseek_v32", "glm_moe_dsa")
PRESETS = ("tiny", "v32-attention")

# Small everything. kv_lora_rank 128 keeps fp8_ds_mla rows possible (one 128-value tile);
# 16 indexer heads make exact-zero score ties (every head's ReLU at 0) unlikely.
_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    kv_lora_rank=128,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=16,
    index_head_dim=64,
    index_n_heads=16,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
)

# The real attention and indexer of each architecture; 2 layers (1 dense, 1 MoE) with a small
# FFN, few experts and a small vocabulary so it fits a GPU benchmark in seconds.
_REAL_ATTENTION: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        hidden_size=7168,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        rms_norm_eps=1e-6,
    ),
    "glm_moe_dsa": dict(
        hidden_size=6144,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        rms_norm_eps=1e-5,
    ),
}
_SMALL_FFN: dict[str, Any] = dict(
    vocab_size=4096,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    intermediate_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    max_position_embeddings=163840,
)


def tiny_config_kwargs(arch: str, preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of the transformers config class for ``arch`` / ``preset``."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: expected one of {ARCHS}")
    if preset == "tiny":
        kw = dict(_TINY)
        if arch == "glm_moe_dsa":
            # IndexShare: layers 0, 1, 3 run an indexer, layer 2 reuses layer 1's top-k.
            kw.update(index_topk_freq=2, index_skip_topk_offset=2)
    elif preset == "v32-attention":
        kw = {**_SMALL_FFN, **_REAL_ATTENTION[arch]}
    else:
        raise ValueError(f"preset {preset!r}: expected one of {PRESETS}")
    kw.update(overrides)
    return kw


def make_tiny(
    arch: str,
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` checkpoint (config.json + model.safetensors) to ``out_dir``.

    Args:
        arch: ``"deepseek_v32"`` or ``"glm_moe_dsa"``.
        out_dir: folder to create (or overwrite).
        preset: ``"tiny"`` (a few hundred kB, for CPU tests; ``index_topk`` 16) or
            ``"v32-attention"`` (the architecture's real attention and indexer dimensions,
            2 layers, small FFN and vocabulary; for GPU benchmarks).
        seed: torch seed of the random initialization.
        dtype: weight dtype written (default fp32 for ``tiny``, bf16 for ``v32-attention``).
        overrides: any other config field (e.g. ``num_hidden_layers=6``).

    Returns the folder. Needs ``transformers`` (a test dependency of hisparse).
    """
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError(
            "make_tiny builds the checkpoint with transformers, which is not installed; "
            "install it with `pip install 'transformers>=5' safetensors` "
            "(or `pip install -e .[test]`)."
        ) from err
    kwargs = tiny_config_kwargs(arch, preset, **overrides)
    if arch == "deepseek_v32":
        cfg_cls, model_cls = "DeepseekV32Config", "DeepseekV32ForCausalLM"
    else:
        cfg_cls, model_cls = "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"
    if not hasattr(transformers, model_cls):
        raise RuntimeError(
            f"transformers {transformers.__version__} has no {model_cls}; "
            "hisparse needs transformers >= 5 for DSA checkpoints."
        )
    config = getattr(transformers, cfg_cls)(**kwargs)
    if dtype is None:
        dtype = torch.float32 if preset == "tiny" else torch.bfloat16
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    _randomize_router_bias(model, seed)
    model = model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def _randomize_router_bias(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-initializes ``e_score_correction_bias``; a random one tests its use."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.02)
