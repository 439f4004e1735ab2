"""Load a DSA checkpoint (config.json + safetensors) into `DsaForCausalLM`.

Accepted layouts and names:

- one ``model.safetensors``, or shards listed in ``model.safetensors.index.json`` (any other
  ``*.safetensors`` files in the folder when neither exists);
- per-expert tensors ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (the original
  releases and what transformers' ``save_pretrained`` writes) or fused 3-D expert tensors
  ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]`` (transformers'
  in-memory layout);
- fp8 block-scaled weights: an e4m3 ``X`` with ``X_scale_inv`` (one fp32 factor per 128 x 128
  tile, DeepSeek's release format; ``quantization_config.weight_block_size`` if given) is
  dequantized at load;
- layers past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer) are skipped.

A missing, unexpected or mis-shaped tensor raises `CheckpointError` naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from hisparse.models.deepseek_v32 import DsaForCausalLM, Indexer, Rotary, Router
from hisparse.models.dsa_config import DsaConfig

#: Side of the square tiles of DeepSeek's fp8 weight scales.
FP8_WEIGHT_BLOCK = 128
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensor."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} lists {f.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def dequantize_fp8_weight(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """fp32 weight from e4m3 ``[..., out, in]`` and 128 x 128 tile scales ``scale_inv``.

    ``scale_inv`` is ``[..., ceil(out / 128), ceil(in / 128)]``: each tile's values times its
    factor give the weight (DeepSeek's ``weight_dequant``).
    """
    out_dim, in_dim = weight.shape[-2:]
    bo, bi = block
    expected = (*weight.shape[:-2], -(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"fp8 scale shape {tuple(scale_inv.shape)} does not tile weight "
            f"{tuple(weight.shape)} in {bo}x{bi} blocks (expected {expected})"
        )
    s = scale_inv.float().repeat_interleave(bo, dim=-2)[..., :out_dim, :]
    s = s.repeat_interleave(bi, dim=-1)[..., :in_dim]
    return weight.float() * s


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield key, handle.get_tensor(key)


def fp8_weight_block(path: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of config.json (DeepSeek: 128 x 128)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)
    block = (cfg.get("quantization_config") or {}).get("weight_block_size")
    if not block:
        return (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)
    return (int(block[0]), int(block[1]))


def read_checkpoint(path: str | Path, config: DsaConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under this model's parameter names, fp8 dequantized to fp32."""
    path = Path(path)
    block = fp8_weight_block(path)
    raw: dict[str, torch.Tensor] = {}
    for key, tensor in _iter_tensors(checkpoint_files(path)):
        m = _LAYER.match(key)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            continue  # MTP layer(s) of the release: not part of the causal LM
        if _IGNORED.search(key):
            continue
        raw[key] = tensor
    out: dict[str, torch.Tensor] = {}
    for key in list(raw):
        if key.endswith("_scale_inv"):
            continue
        tensor = raw[key]
        scale = raw.get(key + "_scale_inv")
        if tensor.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise CheckpointError(f"{key} is fp8 but {key}_scale_inv is missing")
            try:
                tensor = dequantize_fp8_weight(tensor, scale, block)
            except CheckpointError as err:
                raise CheckpointError(f"{key}: {err}") from None
        elif scale is not None:
            raise CheckpointError(f"{key} has a {key}_scale_inv but is {tensor.dtype}, not fp8")
        fused = _FUSED.match(key)
        if fused:
            prefix, kind = fused.groups()
            if tensor.dim() != 3:
                raise CheckpointError(
                    f"{key}: fused experts must be 3-D, got {tuple(tensor.shape)}"
                )
            for e in range(tensor.shape[0]):
                if kind == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
                else:
                    gate, up = tensor[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
        else:
            out[key] = tensor
    orphans = [
        k for k in raw if k.endswith("_scale_inv") and k.removesuffix("_scale_inv") not in raw
    ]
    if orphans:
        raise CheckpointError(f"scale tensors without a weight: {', '.join(orphans[:5])}")
    return out


def load_dsa_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    indexer_mode: str = "exact",
) -> DsaForCausalLM:
    """Build the model of ``path/config.json`` and load its weights.

    ``dtype`` is the compute dtype of every weight except the router and the indexer's
    ``weights_proj``, which stay fp32 as in transformers. Tests use ``torch.float32``.
    """
    config = DsaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DsaForCausalLM(config, indexer_mode=indexer_mode)
    expected = model.state_dict()
    tensors = read_checkpoint(path, config)
    tied = config.tie_word_embeddings and "model.embed_tokens.weight" in tensors
    if tied and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])}{more} for a "
            f"{config.arch} model with {config.num_hidden_layers} layers"
        )
    fp32_names = _fp32_param_names(model)
    state: dict[str, torch.Tensor] = {}
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(t.shape)}, the config implies "
                f"{tuple(ref.shape)}"
            )
        target = torch.float32 if name in fp32_names else dtype
        state[name] = t.to(device=device, dtype=target).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(config).to(device)
    return model.eval()


def _fp32_param_names(model: DsaForCausalLM) -> set[str]:
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, Router):
            names.update(f"{mod_name}.{p}" for p, _ in module.named_parameters())
        elif isinstance(module, Indexer):
            names.add(f"{mod_name}.weights_proj.weight")
    return names
