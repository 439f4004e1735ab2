"""Write random DSA checkpoints in the releases' layout, fp8 block-scaled or not, without
transformers (`hisparse make-tiny --fp8`, the GPU preset with DeepSeek-V3.2's layer shapes).

What a release ships and the loader must meet: a config.json with the release's keys
(``quantization_config`` in DeepSeek's fp8 format, ``num_nextn_predict_layers``), the
transformers names of every tensor, e4m3 weights with an fp32 ``weight_scale_inv`` per
128 x 128 tile for the attention, indexer, MLP and expert projections (embedding, LM head,
norms, router and the indexer's ``weights_proj`` unquantized), the multi-token-prediction layer
(index ``num_hidden_layers``) with its ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head`` and
``embed_tokens``, and safetensors shards listed in ``model.safetensors.index.json``. Tensor
names and shapes come from hisparse's own model (its parameter names are the checkpoints').

Values: normal with std ``initializer_range`` (0.02, transformers' init; norms one), except
that embeddings have unit variance and each residual branch's output projection (``o_proj``,
``down_proj``) is scaled by ``1/sqrt(2·layers)`` (GPT-2's init): in a trained model the residual
stream is large next to any one layer's output, and a random network where every layer's output
is as large as the residual amplifies each rounding (fp8's 3-bit mantissas) into a different
output, which would hide what the fp8 kernels themselves change. fp8 weights are quantized by
`fp8.quantize_weight`; size tests take random e4m3 bytes instead (``random_bytes``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from hisparse.models import fp8
from hisparse.models.checkpoint import TensorInfo
from hisparse.models.dsa_config import DsaConfig

#: The weights DeepSeek's releases keep in e4m3 (transformers names).
RELEASE_FP8 = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|self_attn\.indexer\.(wq_b|wk)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
_ONES = re.compile(r"(layernorm|norm|enorm|hnorm)\.weight$")
#: DeepSeek-V3.1 / V3.2's recipe: power-of-two activation scales.
UE8M0 = fp8.Fp8Format(pow2_scales=True)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def release_config(
    arch: str, kwargs: dict[str, Any], *, fmt: fp8.Fp8Format | None, mtp: int, dtype: torch.dtype
) -> dict[str, Any]:
    """A release-style config.json of ``arch`` with the model fields ``kwargs``."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "num_nextn_predict_layers": mtp,
        **kwargs,
    }
    if fmt is not None:
        cfg["quantization_config"] = fmt.config_entry()
    return cfg


def checkpoint_shapes(config: DsaConfig, mtp: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds (before fp8 scales), by name."""
    from hisparse.models.deepseek_v32 import DsaForCausalLM
    from hisparse.models.mtp import MtpLayer, mtp_prefix

    with torch.device("meta"):
        model = DsaForCausalLM(config)
        for i in range(mtp):
            layer = config.num_hidden_layers + i
            model.mtp.append(MtpLayer(config, layer, sparse=True, indexer=True))
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            _, i, rest = name.split(".", 2)
            name = mtp_prefix(config, int(i)) + rest
        out[name] = tuple(p.shape)
    return out


_RESIDUAL_OUT = re.compile(r"(o_proj|down_proj)\.weight$")


def release_tensors(
    config: DsaConfig, fp8_format: fp8.Fp8Format | None, mtp: int, dtype: torch.dtype
) -> dict[str, TensorInfo]:
    """Every tensor `write_checkpoint` writes for ``config`` (names, dtypes, shapes), as a
    `CheckpointIndex` holds them: planning a release without its bytes."""
    out: dict[str, TensorInfo] = {}
    nowhere = Path()
    for name, shape in checkpoint_shapes(config, mtp).items():
        if fp8_format is not None and RELEASE_FP8.search(name):
            out[name] = TensorInfo(nowhere, fp8.FP8_DTYPE, shape)
            tiles = (fp8.cdiv(shape[0], fp8.BLOCK), fp8.cdiv(shape[1], fp8.BLOCK))
            out[name + "_scale_inv"] = TensorInfo(nowhere, torch.float32, tiles)
        else:
            out[name] = TensorInfo(nowhere, dtype, shape)
    return out


def _values(
    name: str, shape: tuple[int, ...], g: torch.Generator, std: float, layers: int
) -> torch.Tensor:
    """A tensor's random values (module docstring)."""
    if _ONES.search(name):
        return torch.ones(shape)
    if name.endswith("bias") and "e_score_correction" not in name:
        return torch.zeros(shape)
    if name.endswith("embed_tokens.weight"):
        std = 1.0
    elif _RESIDUAL_OUT.search(name):
        std = std / (2 * layers) ** 0.5
    return torch.randn(shape, generator=g) * (std if len(shape) > 1 else 0.02)


def _random_e4m3(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes (NaN codes skipped): a size test's weights, cheap to make."""
    b = torch.empty(shape, dtype=torch.uint8).random_(0, 0x7F, generator=g)  # no 0x7F
    return b.view(torch.float8_e4m3fn)  # positive values up to 448: no NaN


def write_checkpoint(
    arch: str,
    out_dir: str | Path,
    kwargs: dict[str, Any],
    *,
    fp8_format: fp8.Fp8Format | None = UE8M0,
    mtp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    random_bytes: bool = False,
    shard_bytes: int = 2 << 30,
) -> Path:
    """Write config.json, safetensors shards and their index (module docstring) to
    ``out_dir``; ``kwargs``: the model fields (e.g. `tiny.tiny_config_kwargs`). Returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = release_config(arch, kwargs, fmt=fp8_format, mtp=mtp, dtype=dtype)
    config = DsaConfig.from_dict(cfg)
    std = float(cfg["initializer_range"])
    shapes = checkpoint_shapes(config, mtp)
    pow2 = fp8_format is not None and fp8_format.pow2_scales

    def quantized(name: str) -> bool:
        return fp8_format is not None and bool(RELEASE_FP8.search(name))

    def nbytes(name: str, shape: tuple[int, ...]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n * (1 if quantized(name) else dtype.itemsize)

    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        b = nbytes(name, shape)
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    from safetensors.torch import save_file

    for i, names in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            shape = shapes[name]
            if quantized(name) and random_bytes:
                q = _random_e4m3(shape, g)
                s = torch.full((fp8.cdiv(shape[0], fp8.BLOCK), fp8.cdiv(shape[1], fp8.BLOCK)),
                               2.0**-8)  # fmt: skip
                tensors[name], tensors[name + "_scale_inv"] = q, s
            elif quantized(name):
                values = _values(name, shape, g, std, config.num_hidden_layers)
                tensors[name], tensors[name + "_scale_inv"] = fp8.quantize_weight(values, pow2)
            elif random_bytes:
                fill = 1.0 if _ONES.search(name) else 0.0
                tensors[name] = torch.full(shape, fill, dtype=dtype)
            else:
                tensors[name] = _values(name, shape, g, std, config.num_hidden_layers).to(dtype)
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_chat_tokenizer(out, arch, config.vocab_size)
    return out


def write_chat_tokenizer(out: Path, arch: str, vocab_size: int) -> bool:
    """`write_byte_tokenizer` with the family's chat tokens; for GLM-5 (``glm_moe_dsa``) also
    its chat template (`glm_chat.TEMPLATE`) in tokenizer_config.json, as its release ships
    one (DeepSeek-V3.2's ships none: its prompts come from the built-in encoder)."""
    if arch == "glm_moe_dsa":
        from hisparse.models import glm_chat

        if not write_byte_tokenizer(out, vocab_size, glm_chat.SPECIAL_TOKENS):
            return False
        config = {"chat_template": glm_chat.TEMPLATE, "eos_token": "<|endoftext|>"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return True
    from hisparse.models.deepseek_chat import SPECIAL_TOKENS

    return write_byte_tokenizer(out, vocab_size, SPECIAL_TOKENS if arch == "deepseek_v32" else ())


def write_byte_tokenizer(out: Path, vocab_size: int, special: tuple[str, ...] = ()) -> bool:
    """A byte-level tokenizer.json (``<s>`` 0, ``</s>`` 1, the 256 bytes from 2, then the
    ``special`` tokens of the family's chat format from 258) so that ``hisparse generate`` and
    ``chat`` can encode text for a random checkpoint; False where the vocabulary is too small
    or ``tokenizers`` is missing."""
    if vocab_size < 258 + len(special):
        return False
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1} | {ch: i + 2 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", *special])
    tok.save(str(out / "tokenizer.json"))
    return True
