"""Cache shapes of the supported DSA models: which layers cache what, per token.

The layout planner only needs the ordered list of per-layer cache specs and the model's
``index_topk``; this module produces them for the built-in presets and for a Hugging Face
``config.json`` (``deepseek_v32`` or ``glm_moe_dsa``) without importing ``transformers``.

Spec order is layer order: ``layers.{i}.attn`` (sparse MLA), then ``layers.{i}.indexer`` when
layer ``i`` runs its own lightning indexer. IndexShare layers (GLM-5.2 schedule) own no indexer
and name the preceding full layer as ``index_leader``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hisparse.config import HiSparseConfigError
from hisparse.kv.specs import (
    CacheKind,
    LayerCacheSpec,
    RowFormat,
    indexer_spec,
    sparse_mla_spec,
)

#: ``model_type`` values of a Hugging Face config.json this module understands.
SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
#: MLA row formats a sparse layer may be stored in (``--kv-format``).
SUPPORTED_KV_FORMATS = (RowFormat.FP8_DS_MLA.value, RowFormat.BF16_MLA.value)

# Defaults of the transformers config classes, used for keys a config.json leaves out.
_HF_DEFAULTS: dict[str, dict[str, int]] = {
    "deepseek_v32": {
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 2048,
        "index_head_dim": 128,
    },
    "glm_moe_dsa": {
        "num_hidden_layers": 78,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 2048,
        "index_head_dim": 128,
    },
}
# transformers' GlmMoeDsaConfig uses offset 2 when a config declares a frequency but no offset.
_DEFAULT_SKIP_TOPK_OFFSET = 2


@dataclass(frozen=True)
class ModelCacheShape:
    """What a model caches: its specs in layer order and the top-k its indexer selects."""

    name: str
    specs: list[LayerCacheSpec]
    index_topk: int
    num_layers: int

    @property
    def sparse_specs(self) -> list[LayerCacheSpec]:
        return [s for s in self.specs if s.kind is CacheKind.SPARSE]

    @property
    def indexer_specs(self) -> list[LayerCacheSpec]:
        return [s for s in self.specs if s.kind is CacheKind.INDEXER]

    @property
    def kv_format(self) -> RowFormat | None:
        sparse = self.sparse_specs
        return sparse[0].row_format if sparse else None


def parse_kv_format(kv_format: str | RowFormat) -> RowFormat:
    """``"fp8_ds_mla"`` / ``"bf16"`` (or the enum) -> `RowFormat`; anything else is an error."""
    if isinstance(kv_format, RowFormat):
        fmt = kv_format
    else:
        try:
            fmt = RowFormat(kv_format)
        except ValueError:
            fmt = None  # type: ignore[assignment]
    if fmt is None or fmt.value not in SUPPORTED_KV_FORMATS:
        raise HiSparseConfigError(
            f"kv format {kv_format!r} is not an MLA row format HiSparse stores; "
            f"use one of {', '.join(SUPPORTED_KV_FORMATS)}."
        )
    return fmt


def indexer_schedule(
    num_layers: int,
    *,
    index_topk_freq: int = 1,
    index_skip_topk_offset: int = _DEFAULT_SKIP_TOPK_OFFSET,
    index_topk_pattern: str | Sequence[str] | None = None,
    indexer_types: Sequence[str] | None = None,
) -> list[bool]:
    """Per layer: does it run its own indexer ("full") or reuse the previous full layer's top-k?

    Precedence follows transformers' GlmMoeDsaConfig: explicit ``indexer_types`` ("full" /
    "shared"), else ``index_topk_pattern`` ("F" / "S" per layer), else the IndexShare rule: layer
    ``i`` is full iff ``max(i - offset + 1, 0) % freq == 0``. A leading shared layer has no
    full layer to borrow from, so layer 0 is always full.
    """
    if num_layers <= 0:
        raise HiSparseConfigError(f"num_hidden_layers={num_layers} must be positive.")
    if indexer_types is not None:
        full = [_parse_layer_mode(m, i, "indexer_types") for i, m in enumerate(indexer_types)]
        _check_schedule_length(full, num_layers, "indexer_types")
    elif index_topk_pattern is not None:
        full = [
            _parse_layer_mode(m, i, "index_topk_pattern") for i, m in enumerate(index_topk_pattern)
        ]
        _check_schedule_length(full, num_layers, "index_topk_pattern")
    else:
        if isinstance(index_topk_freq, bool) or not isinstance(index_topk_freq, int):
            raise HiSparseConfigError(f"index_topk_freq={index_topk_freq!r} must be an integer.")
        freq = max(index_topk_freq, 1)
        full = [max(i - index_skip_topk_offset + 1, 0) % freq == 0 for i in range(num_layers)]
    full[0] = True
    return full


def dsa_cache_specs(
    full_indexer: Sequence[bool],
    *,
    block_size: int,
    kv_format: str | RowFormat = RowFormat.FP8_DS_MLA,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    index_head_dim: int = 128,
) -> list[LayerCacheSpec]:
    """Specs of a DSA model whose layer ``i`` owns an indexer iff ``full_indexer[i]``."""
    fmt = parse_kv_format(kv_format)
    if fmt is RowFormat.FP8_DS_MLA and kv_lora_rank % 128:
        raise HiSparseConfigError(
            f"kv_lora_rank={kv_lora_rank} is not a multiple of 128, which fp8_ds_mla needs (one "
            "fp32 scale per 128 values); use kv format bf16."
        )
    if not full_indexer or not full_indexer[0]:
        raise HiSparseConfigError("layer 0 must run its own indexer: no earlier top-k exists.")
    specs: list[LayerCacheSpec] = []
    leader = ""
    for i, full in enumerate(full_indexer):
        name = f"layers.{i}.attn"
        if full:
            leader = name
        specs.append(
            sparse_mla_spec(
                name,
                block_size=block_size,
                fmt=fmt,
                index_leader=leader,
                kv_lora_rank=kv_lora_rank,
                rope_dim=rope_dim,
            )
        )
        if full:
            specs.append(
                indexer_spec(f"layers.{i}.indexer", block_size=block_size, head_dim=index_head_dim)
            )
    return specs


def deepseek_v32_cache_shape(
    *, block_size: int = 64, kv_format: str | RowFormat = RowFormat.FP8_DS_MLA
) -> ModelCacheShape:
    """DeepSeek-V3.2: 61 layers, every layer has its own indexer (index groups of one)."""
    return _dsa_shape(
        "deepseek-v3.2", _HF_DEFAULTS["deepseek_v32"], [True] * 61, block_size, kv_format
    )


def glm5_cache_shape(
    *,
    block_size: int = 64,
    kv_format: str | RowFormat = RowFormat.FP8_DS_MLA,
    index_topk_freq: int = 4,
    index_skip_topk_offset: int = 3,
) -> ModelCacheShape:
    """GLM-5 dimensions (78 layers) with the GLM-5.2 IndexShare schedule.

    Defaults are those of zai-org/GLM-5.2's config.json (freq 4, offset 3): layers 0, 1, 2 and
    every fourth layer from 6 on run an indexer (21 of 78); the others reuse its top-k.
    """
    dims = _HF_DEFAULTS["glm_moe_dsa"]
    full = indexer_schedule(
        dims["num_hidden_layers"],
        index_topk_freq=index_topk_freq,
        index_skip_topk_offset=index_skip_topk_offset,
    )
    return _dsa_shape("glm-5", dims, full, block_size, kv_format)


#: Built-in model names accepted by `load_model_cache_shape` (and ``hisparse plan --model``).
PRESETS = {
    "deepseek-v3.2": deepseek_v32_cache_shape,
    "glm-5": glm5_cache_shape,
}


def cache_shape_from_hf_config(
    config: str | Path | Mapping[str, Any],
    *,
    block_size: int = 64,
    kv_format: str | RowFormat = RowFormat.FP8_DS_MLA,
) -> ModelCacheShape:
    """Cache shape from a Hugging Face config: a ``config.json`` path, a model folder, or a dict."""
    if isinstance(config, Mapping):
        cfg, name = dict(config), str(config.get("_name_or_path", "config"))
    else:
        cfg, name = _read_config_json(Path(config))
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HiSparseConfigError(
            f"{name}: model_type {model_type!r} is not supported; HiSparse plans caches for "
            f"model_type {' or '.join(SUPPORTED_MODEL_TYPES)} (DeepSeek-V3.2, GLM-5)."
        )
    dims = {
        key: _int_field(cfg, key, default, name)
        for key, default in _HF_DEFAULTS[model_type].items()
    }
    if model_type == "deepseek_v32":
        full = [True] * dims["num_hidden_layers"]
    else:
        full = indexer_schedule(
            dims["num_hidden_layers"],
            index_topk_freq=cfg.get("index_topk_freq") or 1,
            index_skip_topk_offset=_int_field(
                cfg, "index_skip_topk_offset", _DEFAULT_SKIP_TOPK_OFFSET, name
            ),
            index_topk_pattern=cfg.get("index_topk_pattern"),
            indexer_types=cfg.get("indexer_types"),
        )
    return _dsa_shape(name, dims, full, block_size, kv_format)


def load_model_cache_shape(
    model: str | Path,
    *,
    block_size: int = 64,
    kv_format: str | RowFormat = RowFormat.FP8_DS_MLA,
) -> ModelCacheShape:
    """A preset name (``deepseek-v3.2``, ``glm-5``) or a path to a config.json / model folder."""
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model](block_size=block_size, kv_format=kv_format)
    path = Path(model)
    if not path.exists():
        raise HiSparseConfigError(
            f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
            "config.json or model folder."
        )
    return cache_shape_from_hf_config(path, block_size=block_size, kv_format=kv_format)


def with_mtp_layer(
    shape: ModelCacheShape, config_json: str | Path | None, num_speculative_tokens: int
) -> ModelCacheShape:
    """``shape`` with the multi-token-prediction layer MTP speculative decoding runs (after
    the last layer: its MLA rows and its own indexer, an index group of one), as the engine's
    layout holds it; refused for a config.json without one (``num_nextn_predict_layers``) or
    with no draft token to make."""
    if num_speculative_tokens < 1:
        raise HiSparseConfigError(
            "--speculative-method mtp drafts --num-speculative-tokens tokens a step: give at "
            "least 1, e.g. --num-speculative-tokens 2."
        )
    if config_json is not None:
        cfg, where = _read_config_json(Path(config_json))
        if not cfg.get("num_nextn_predict_layers"):
            raise HiSparseConfigError(
                f"{where}: num_nextn_predict_layers is 0 or missing: the checkpoint has no MTP "
                "layer to draft with; plan --speculative-method ngram."
            )
    sparse = shape.sparse_specs[0]
    idx = shape.indexer_specs[0]
    name = f"layers.{shape.num_layers}"
    attn = dataclasses.replace(sparse, name=f"{name}.attn", index_leader=f"{name}.attn")
    extra = [attn, dataclasses.replace(idx, name=f"{name}.indexer")]
    return dataclasses.replace(
        shape,
        name=f"{shape.name} with its MTP layer",
        specs=[*shape.specs, *extra],
        num_layers=shape.num_layers + 1,
    )


def _dsa_shape(
    name: str,
    dims: Mapping[str, int],
    full: Sequence[bool],
    block_size: int,
    kv_format: str | RowFormat,
) -> ModelCacheShape:
    specs = dsa_cache_specs(
        full,
        block_size=block_size,
        kv_format=kv_format,
        kv_lora_rank=dims["kv_lora_rank"],
        rope_dim=dims["qk_rope_head_dim"],
        index_head_dim=dims["index_head_dim"],
    )
    return ModelCacheShape(
        name=name, specs=specs, index_topk=dims["index_topk"], num_layers=len(full)
    )


def _read_config_json(path: Path) -> tuple[dict[str, Any], str]:
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise HiSparseConfigError(f"no config.json at {path}.") from None
    except (OSError, json.JSONDecodeError) as err:
        raise HiSparseConfigError(f"cannot read {path} as JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise HiSparseConfigError(f"{path} does not hold a JSON object.")
    return cfg, str(path)


def _int_field(cfg: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise HiSparseConfigError(f"{where}: {key}={value!r} must be an integer.")
    return value


def _parse_layer_mode(mode: object, layer: int, field: str) -> bool:
    text = str(mode).strip().lower()
    if text in ("f", "full"):
        return True
    if text in ("s", "shared"):
        return False
    raise HiSparseConfigError(f"{field}[{layer}]={mode!r}: expected 'F'/'full' or 'S'/'shared'.")


def _check_schedule_length(full: list[bool], num_layers: int, field: str) -> None:
    if len(full) != num_layers:
        raise HiSparseConfigError(
            f"{field} has {len(full)} entries but the model has {num_layers} layers "
            "(num_hidden_layers); give one entry per layer."
        )
