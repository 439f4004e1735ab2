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

ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")
PRESETS = ("tiny", "v32-attention", "v32-shapes", "v4-attention")

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


# fp8 tiny checkpoints: each of 2 ranks' input slices of o_proj and the down projections a
# whole 128-column scale tile, so tensor parallelism quantizes the same activation groups.
_TINY_FP8: dict[str, Any] = dict(v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)

# DeepSeek-V3.2's real layer shapes (attention, indexer, dense MLP and expert widths) with fewer
# experts and layers and a small vocabulary: 1 dense + 2 MoE layers of 16 experts (8 per token,
# 8 groups, 4 chosen) and the MTP layer, ~3.4 GB in fp8, for GPU runs of the fp8 kernels.
_V32_SHAPES: dict[str, Any] = dict(
    _REAL_ATTENTION["deepseek_v32"],
    vocab_size=16384,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    max_position_embeddings=163840,
)


def tiny_config_kwargs(
    arch: str, preset: str = "tiny", *, fp8: bool = False, **overrides: Any
) -> dict[str, Any]:
    """Keyword arguments of the transformers config class for ``arch`` / ``preset`` (``fp8``:
    the tile-aligned widths of fp8 tiny checkpoints)."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: expected one of {ARCHS}")
    if arch == "deepseek_v4" or preset == "v4-attention":
        if arch != "deepseek_v4" or fp8:
            raise ValueError(
                "preset 'v4-attention' is DeepSeek-V4's (arch deepseek_v4), and deepseek_v4 "
                "checkpoints are written unquantized (no --fp8)"
            )
        from hisparse.models.v4_tiny import v4_config_kwargs

        return v4_config_kwargs(preset, **overrides)
    if preset == "tiny":
        kw = dict(_TINY, **(_TINY_FP8 if fp8 else {}))
        if arch == "glm_moe_dsa":
            # IndexShare: layers 0, 1, 3 run an indexer, layer 2 reuses layer 1's top-k.
            kw.update(index_topk_freq=2, index_skip_topk_offset=2)
    elif preset == "v32-attention":
        kw = {**_SMALL_FFN, **_REAL_ATTENTION[arch]}
    elif preset == "v32-shapes":
        if arch != "deepseek_v32":
            raise ValueError("preset 'v32-shapes' is DeepSeek-V3.2's (arch deepseek_v32)")
        kw = dict(_V32_SHAPES)
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
    fp8: bool = False,
    mtp: bool | None = None,
    tokenizer: bool = False,
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
        fp8: write the releases' fp8 format (`checkpoint_writer`: e4m3 weights with 128 x 128
            tile scales, ue8m0, DeepSeek's ``quantization_config``, a byte-level tokenizer)
            instead of transformers' own checkpoint; the ``v32-shapes`` preset always goes
            this way (``fp8`` off: bf16 weights).
        mtp: write the multi-token-prediction layer (default: with ``fp8``); with ``fp8`` off
            the checkpoint goes through `checkpoint_writer` too (the releases' names, plain
            weights), which the MTP speculative decoding tests load.
        tokenizer: also write a byte-level ``tokenizer.json`` (`write_chat_tokenizer`; the
            ``fp8`` path always does) holding the family's chat tokens (DeepSeek-V3.2's prompts
            come from the built-in encoder; GLM-5's template goes into tokenizer_config.json),
            so text prompts, chat, structured outputs and tools run; ``hisparse make-tiny``
            writes it.
        overrides: any other config field (e.g. ``num_hidden_layers=6``).

    Returns the folder. Needs ``transformers`` (a test dependency of hisparse) unless it goes
    through `checkpoint_writer`. ``deepseek_v4`` goes through `v4_tiny.make_tiny_v4` (the
    release's tensor names, a byte-level tokenizer).
    """
    if arch == "deepseek_v4":
        from hisparse.models.v4_tiny import make_tiny_v4

        tiny_config_kwargs(arch, preset, fp8=fp8)  # refuses the combinations it cannot write
        return make_tiny_v4(out_dir, preset, seed, dtype=dtype, **overrides)
    if fp8 or preset == "v32-shapes" or mtp:
        from hisparse.models import checkpoint_writer
        from hisparse.models.fp8 import Fp8Format

        kwargs = tiny_config_kwargs(arch, preset, fp8=fp8, **overrides)
        return checkpoint_writer.write_checkpoint(
            arch,
            out_dir,
            kwargs,
            fp8_format=Fp8Format(pow2_scales=True) if fp8 else None,
            mtp=1 if mtp is None or mtp else 0,
            dtype=dtype or (torch.float32 if preset == "tiny" else torch.bfloat16),
            seed=seed,
        )
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
    if tokenizer:
        from hisparse.models.checkpoint_writer import write_chat_tokenizer

        write_chat_tokenizer(out, arch, config.vocab_size)
    return out


def _randomize_router_bias(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-initializes ``e_score_correction_bias``; a random one tests its use."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.02)
