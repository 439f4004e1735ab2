"""Small random DeepSeek-V4 checkpoints in the release's tensor names, for tests and benchmarks.

transformers' ``DeepseekV4ForCausalLM`` initializes the model; the parameters it zero-initializes
(sinks, compressor position biases, hyper-connection biases, router biases) and the hash
routing table get random values so the tests exercise them; ``save_pretrained`` writes the
tensors, renamed here to the release's names (no ``model.`` prefix, ``embed.weight``,
``hc_head_fn`` ...), which transformers loads back through its own conversion mapping. A
byte-level tokenizer comes with it so that text goes in and out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hisparse.models.v4_config import CSA, HCA, SLIDING

PRESETS = ("tiny", "v4-attention")

# Small everything; compression rates 4 (CSA) and 8 (HCA) and a window of 8, so a prompt of a
# few dozen tokens spans the window and several entries of both; index_topk 3 < the entries
# of such a prompt, so the indexer's choice matters. 16 indexer heads make exact score ties
# (every head's ReLU at zero) unlikely.
_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    compress_rates={CSA: 4, HCA: 8},
    layer_types=[HCA, CSA, SLIDING, CSA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_mult=4,
    max_position_embeddings=4096,
    initializer_range=0.1,
)

# DeepSeek-V4-Flash's attention (64 heads of 512, one KV head, top-k 512 of 4-token entries,
# 128-token entries, a 128-token window, 4 hyper-connection streams) in 2 layers (one CSA,
# one HCA) with few small experts and a small vocabulary, for GPU runs.
_V4_ATTENTION: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=4096,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=64,
    head_dim=512,
    partial_rotary_factor=64 / 512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    compress_rates={CSA: 4, HCA: 128},
    layer_types=[CSA, HCA],
    mlp_layer_types=["hash_moe", "moe"],
    hc_mult=4,
    max_position_embeddings=1048576,
)


def v4_config_kwargs(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of transformers' ``DeepseekV4Config`` for ``preset``."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} for deepseek_v4: expected one of {PRESETS}")
    kw = dict(_TINY if preset == "tiny" else _V4_ATTENTION)
    kw.update(overrides)
    n = kw["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types"):  # a --layers override: extend the schedule
        sched = list(kw[key])
        kw[key] = (sched * -(-n // len(sched)))[:n]
    return kw


def _randomize(model: torch.nn.Module, config: Any, seed: int) -> None:
    """Random values where transformers initializes constants (module docstring)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                k, e = t.shape[1], config.n_routed_experts
                t.copy_(
                    torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t.shape[0])])
                )
            elif name.endswith(("sinks", "position_bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("e_score_correction_bias", ".base", "hc_base")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif ("hc" in name and name.endswith("scale")) or (
                "norm" in name and name.endswith("weight")
            ):  # factors around one
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.1)


def make_tiny_v4(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> Path:
    """Write a random DeepSeek-V4 checkpoint (config.json, model.safetensors in the release's
    names, tokenizer.json) to ``out_dir``; ``dtype`` defaults to fp32 (``tiny``) or bf16."""
    import transformers
    from safetensors.torch import load_file, save_file

    from hisparse.models.checkpoint_writer import write_byte_tokenizer
    from hisparse.models.v4_loader import release_name

    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        raise RuntimeError(
            f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM; "
            "hisparse needs transformers >= 5.25 to build DeepSeek-V4 checkpoints."
        )
    config = transformers.DeepseekV4Config(**v4_config_kwargs(preset, **overrides))
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config)
    _randomize(model, config, seed)
    if dtype is None:
        dtype = torch.float32 if preset == "tiny" else torch.bfloat16
    model = model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({release_name(k): v for k, v in load_file(f).items()})
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_byte_tokenizer(out, config.vocab_size)
    return out
