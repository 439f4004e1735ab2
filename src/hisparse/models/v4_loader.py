"""Load a DeepSeek-V4 checkpoint (config.json + safetensors) into `DeepseekV4ForCausalLM`.

The release names its tensors ``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``hc_head_fn``
...; transformers' ``save_pretrained`` writes the same names under a ``model.`` prefix, with
``model.embed_tokens``, ``model.hc_head.hc_fn`` and ``attn.norm`` for ``attn.kv_norm``: both
load. Weights the release quantizes
(fp8 with UE8M0 scales, 4-bit experts: `v4_quant`) stay quantized (`load_v4_model`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hisparse.models.checkpoint import CheckpointError, CheckpointIndex, SliceReader
from hisparse.models.deepseek_v4 import DeepseekV4ForCausalLM
from hisparse.models.v4_config import V4Config

#: transformers-saved names that differ from the release's beyond the ``model.`` prefix
_ALIASES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"\.attn\.norm\.weight$"), ".attn.kv_norm.weight"),
)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)

#: parameters kept in fp32 whatever the model dtype (transformers keeps them so too)
_FP32 = re.compile(r"(norm\.weight|attn_sink|\.ape|hc_\w+|gate\.bias)$")


def release_name(name: str) -> str:
    """The release's name of a checkpoint tensor named either way (module docstring)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


def _is_scale(name: str) -> bool:
    return name.endswith(".scale") or name.endswith("weight_scale_inv")


def _keeps_fp8(key: str, ckpt: CheckpointIndex, names: dict[str, str]) -> bool:
    """Whether weight ``key`` stays e4m3 (an `Fp8Linear`): an fp8 tensor of a layer the model
    calls as a module (``wo_a`` is read as grouped weights: it is dequantized)."""
    info = ckpt.get(names[key])
    return (
        info is not None
        and info.dtype == torch.float8_e4m3fn
        and not key.endswith("attn.wo_a.weight")
    )


def _index(split: Any) -> tuple[slice, ...]:
    """The index of a `parallel.shard.Split` ``(dim, start, length)`` (None: all of it)."""
    if split is None:
        return ()
    dim, start, length = split
    return (slice(None),) * dim + (slice(start, start + length),)


def _is_fp4(ckpt: CheckpointIndex, name: str) -> bool:
    """Whether checkpoint tensor ``name`` holds packed e2m1 pairs (int8, the release's 4-bit
    experts): they stay 4-bit as `Fp4Linear` layers."""
    info = ckpt.get(name)
    return info is not None and info.dtype == torch.int8


def _pow2_activations(path: Path, ckpt: CheckpointIndex, scale_names: list[str]) -> bool:
    """Power-of-two activation scales where the checkpoint's are UE8M0 (``scale_fmt``, or
    exponent-byte scale tensors)."""
    q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if "scale_fmt" in q:
        return q["scale_fmt"] == "ue8m0"
    return any(ckpt[n].dtype in (torch.uint8, _E8M0) for n in scale_names)


def load_v4_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: Any = None,
) -> DeepseekV4ForCausalLM:
    """The model of checkpoint folder ``path`` in ``dtype`` (fp32 parameters stay fp32).
    fp8 weights stay e4m3 as `Fp8Linear` layers (W8A8 GEMMs, their UE8M0 scales as fp32
    factors: exact), 4-bit experts stay packed as `Fp4Linear` layers (dequantized per call);
    ``wo_a`` is dequantized to ``dtype``. ``tp`` (a `hisparse.parallel.TPGroup`): this rank's
    shard (`parallel.shard_v4`), read slice by slice from the checkpoint."""
    from hisparse.models.fp8_linear import Fp8Linear
    from hisparse.models.v4_quant import Fp4Linear, dequantize_tensor, ue8m0_to_float

    path = Path(path)
    config = V4Config.from_pretrained(path)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    ckpt = CheckpointIndex(path)
    names = {release_name(k): k for k in ckpt.tensors if not k.startswith("mtp.")}
    scales = {
        re.sub(r"\.(scale|weight_scale_inv)$", ".weight", release_name(k)): k
        for k in ckpt.tensors
        if _is_scale(k)
    }
    keep = {k for k in scales if k in names and _keeps_fp8(k, ckpt, names)}
    keep4 = {k for k in scales if k in names and _is_fp4(ckpt, names[k])}
    pow2 = _pow2_activations(path, ckpt, list(scales.values()))
    for key in keep | keep4:
        module = key[: -len(".weight")]
        linear = model.get_submodule(module)
        if isinstance(linear, nn.Linear):
            swap = Fp8Linear.like(linear, pow2) if key in keep else Fp4Linear.like(linear)
            model.set_submodule(module, swap)
    splits: dict[str, Any] = {}
    if tp is not None:
        from hisparse.parallel.shard_v4 import shard_v4

        splits = shard_v4(model, tp)  # the meta shapes this rank keeps, and their slices
    state = model.state_dict(keep_vars=True)
    missing = [
        k for k in state
        if k not in names and not k.startswith("rotary_") and not k.endswith("weight_scale_inv")
    ]  # fmt: skip
    if missing:
        raise CheckpointError(
            f"{path}: the checkpoint lacks {len(missing)} tensors of a deepseek_v4 model of "
            f"this config.json, e.g. {missing[:3]}; is it a DeepSeek-V4 checkpoint?"
        )
    values: dict[str, torch.Tensor] = {}
    with SliceReader(ckpt) as reader:
        for key, param in state.items():
            if key.startswith("rotary_"):
                continue
            part = _index(splits.get(key))
            if key.endswith("weight_scale_inv"):
                weight = key[: -len("_scale_inv")]
                t = reader.read(scales[weight], part)
                if weight in keep4:  # an Fp4Linear's exponent bytes, as they ship
                    t, want = t.view(torch.uint8), torch.uint8
                else:  # an Fp8Linear's tile factors
                    t, want = ue8m0_to_float(t), torch.float32
            else:
                whole = key in scales and key not in keep | keep4  # dequantized here
                t = reader.read(names[key], () if whole else part)
                if key in keep | keep4:
                    want = t.dtype
                elif whole:
                    t = dequantize_tensor(t, reader.read(scales[key]))[part]
                    want = dtype
                else:
                    want = torch.long if key.endswith("tid2eid") else dtype
                if _FP32.search(key):
                    want = torch.float32
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(f"{path}: {key} has shape {tuple(t.shape)}, "
                                      f"this config.json needs {tuple(param.shape)}")  # fmt: skip
            values[key] = t.to(device=device, dtype=want)
    model.load_state_dict(values, strict=False, assign=True)
    model.rotary_main.to(device)  # built on the CPU inside the meta skeleton
    model.rotary_compress.to(device)
    if keep:
        from hisparse.models import fp8_linear

        fp8_linear.prepare(torch.device(device))  # the GEMM, chosen before any graph capture
    return model.eval()
