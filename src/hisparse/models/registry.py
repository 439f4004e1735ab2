"""The model registry: which model family a checkpoint is, how it loads, what it caches.

Three families: DeepSeek-V4 (`deepseek_v4`, `hisparse.models.deepseek_v4`; all-GPU placement
only for now), DSA checkpoints (`deepseek_v32`, `glm_moe_dsa`: a folder with config.json and
safetensors; MLA rows, an indexer cache on every full indexer layer) and Llama GQA models from
a GGUF file (SmolLM2 bundled; K+V rows and a compact key cache per layer). The engine
(`hisparse.LLM`) loads through `load_model` and sizes its pools from `engine_specs`; the
planner (`hisparse plan`) reads the same shapes without loading weights
(`hisparse.kv.cache_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hisparse.config import (
    ROW_ALIGNMENT_BYTES,
    HiSparseConfig,
    HiSparseConfigError,
    ResolvedHiSparseConfig,
)
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.kv.row_formats import MLA_TILE, IndexerCacheFormat, mla_row_bytes
from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat
from hisparse.models.deepseek_v4 import DeepseekV4ForCausalLM
from hisparse.models.deepseek_v32 import DsaForCausalLM
from hisparse.models.source import require_weights, resolve_model_source
from hisparse.models.v4_cache import hisparse_row_layout, row_values
from hisparse.models.v4_config import CSA, V4Config

#: ``kv_format`` values: ``auto`` picks per checkpoint and device (`LLM`)
KV_FORMATS = ("auto", "fp8_ds_mla", "bf16", "fp32")


GQA_KV_FORMATS = ("auto", "bf16", "fp32")


#: ``indexer`` values: DSA models take the first two, GQA models all four
INDEXERS = ("fp8", "exact", "quest", "lowrank")


DSA_INDEXERS = ("fp8", "exact")


#: top_k of GQA models, which declare none: the smallest budget that kept needle retrieval equal
#: to dense in docs/quality.md (2K, 4K and 8K contexts).
DEFAULT_GQA_TOP_K = 256


def indexer_method(indexer: str) -> str:
    """DSA indexer modes map onto the GQA scorer: fp8 keys for either."""
    return "fp8" if indexer in ("fp8", "exact") else indexer


def resolve_model(model: str | Path) -> Path:
    """The weights `LLM` loads: a checkpoint folder or a ``.gguf`` file
    (`hisparse.models.source`: the resolver every subcommand shares)."""
    src = resolve_model_source(model, name="LLM.model")
    return require_weights(src, "LLM", name="LLM.model")


def dsa_row_format(mcfg: Any, kv_format: str, dtype: torch.dtype, device: torch.device) -> str:
    """The MLA row format for ``kv_format`` on this checkpoint, or a `HiSparseConfigError`
    naming one that works: rows move with 16-byte accesses (and fp8_ds_mla needs whole
    128-value tiles)."""

    rank, rope = mcfg.kv_lora_rank, mcfg.qk_rope_head_dim

    def row(fmt: str) -> int | None:
        if fmt == "fp8_ds_mla" and rank % MLA_TILE:
            return None
        size = mla_row_bytes(fmt, rank, rope)
        return size if size % ROW_ALIGNMENT_BYTES == 0 else None

    if kv_format == "auto":
        fallback = "fp32" if dtype == torch.float32 and device.type == "cpu" else "bf16"
        for fmt in ("fp8_ds_mla", fallback, "bf16", "fp32"):
            if row(fmt) is not None:
                return fmt
    elif row(kv_format) is not None:
        return kv_format
    working = [fmt for fmt in ("fp8_ds_mla", "bf16", "fp32") if row(fmt) is not None]
    why = (
        f"needs kv_lora_rank to be a multiple of {MLA_TILE}"
        if kv_format == "fp8_ds_mla" and rank % MLA_TILE
        else f"gives rows of {mla_row_bytes(kv_format, rank, rope)} bytes"
        if kv_format != "auto"
        else "finds no format"
    )
    fix = (
        f"use kv_format={working[0]!r}"
        if working
        else f"no MLA row format of kv_lora_rank {rank} + rope {rope} is 16-byte aligned"
    )
    raise HiSparseConfigError(
        f"LLM.kv_format={kv_format!r} {why} for this checkpoint (kv_lora_rank {rank}, "
        f"qk_rope_head_dim {rope}); HiSparse copies rows with {ROW_ALIGNMENT_BYTES}-byte "
        f"accesses; {fix}.",
        field="LLM.kv_format",
        value=kv_format,
    )


def set_index_topk(model: torch.nn.Module, top_k: int) -> None:
    for module in model.modules():
        if module.__class__.__name__ == "Indexer":
            module.topk = top_k  # type: ignore[assignment]


def load_tokenizer(path: Path):
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def eos_ids(path: Path, mcfg: object) -> set[int]:
    eos = getattr(mcfg, "eos_token_id", None)
    if eos is None:
        import json

        cfg = json.loads((path / "config.json").read_text())
        eos = cfg.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


@dataclass
class LoadedModel:
    """A loaded checkpoint and what the engine needs to know of it."""

    model: torch.nn.Module
    #: the HiSparse settings resolved against the model (its top_k default)
    config: ResolvedHiSparseConfig
    tokenizer: Any
    chat_template: Any
    eos_token_ids: set[int]
    #: the KV row format: a DSA format name, or a GQA `row_format` object
    row_format: object
    #: the model's context limit (max_position_embeddings)
    max_len: int

    @property
    def grammars(self) -> Any:
        """The structured outputs' grammar compiler and cache for this vocabulary (an
        `engine.grammar.Grammars`; xgrammar is imported at the first compile)."""
        from hisparse.engine.grammar import Grammars

        return Grammars(self.tokenizer, self.model, self.eos_token_ids)


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def is_v4(path: Path) -> bool:
    """Whether ``path`` is a DeepSeek-V4 checkpoint folder (``model_type: deepseek_v4``)."""
    if is_gguf(path) or not (path / "config.json").is_file():
        return False
    import json

    return json.loads((path / "config.json").read_text()).get("model_type") == "deepseek_v4"


#: ``kv_format`` of DeepSeek-V4 rows: the model dtype's (``auto``), or the one named
V4_KV_FORMATS = ("auto", "bf16", "fp32")


def _load_v4(
    path: Path,
    hs: HiSparseConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: str,
    tp: Any = None,
) -> LoadedModel:
    """A DeepSeek-V4 checkpoint for the engine: its rows in the model dtype (`v4_cache`)."""
    from hisparse.models.tokenizer import load_chat_template
    from hisparse.models.v4_loader import load_v4_model

    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if kv_format not in ("auto", names.get(dtype)):
        raise HiSparseConfigError(
            f"LLM.kv_format={kv_format!r}: DeepSeek-V4 keeps its rows in the model dtype "
            f"({dtype}); use kv_format='auto'.",
            field="LLM.kv_format",
            value=kv_format,
        )
    model = load_v4_model(path, dtype=dtype, device=device, tp=tp)
    mcfg = model.config
    config = hs.resolve(model_top_k=mcfg.index_topk)
    if config.top_k != mcfg.index_topk:
        set_index_topk(model, config.top_k)
    return LoadedModel(
        model, config, load_tokenizer(path), load_chat_template(path), eos_ids(path, mcfg),
        names.get(dtype, str(dtype)), mcfg.max_position_embeddings,
    )  # fmt: skip


def load_model(
    path: Path,
    hs: HiSparseConfig,
    dtype: torch.dtype,
    device: torch.device,
    indexer: str,
    kv_format: str,
    tp: Any = None,
    experts: tuple[int, int] | None = None,
) -> LoadedModel:
    """Load the checkpoint at ``path`` (`resolve_model`) for the engine (``experts``: the
    routed experts ``(first, count)`` an expert-parallel rank keeps). ``tp`` (a
    `hisparse.parallel.TPGroup`): a DSA checkpoint loads this rank's shard straight onto
    ``device`` (`load_dsa_model`: each rank reads only its slices); a GGUF model loads on the
    CPU, keeps this rank's shard (`hisparse.parallel.shard`), then moves to ``device``."""
    if tp is not None and is_gguf(path):
        from hisparse.parallel.shard import shard_gqa_row_format, shard_llama

        loaded = load_model(path, hs, dtype, torch.device("cpu"), indexer, kv_format)
        loaded.model = shard_llama(loaded.model, tp).to(device)
        if device.type == "cuda":
            loaded.model.prepare_fused()
        loaded.row_format = shard_gqa_row_format(loaded.row_format, tp.world_size)
        return loaded
    if is_v4(path):  # under tensor parallelism each rank reads its slices (`shard_v4`)
        return _load_v4(path, hs, dtype, device, kv_format, tp)
    if is_gguf(path):
        # A GQA model (SmolLM2 by default): training-free indexer, K+V rows.
        from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
        from hisparse.models.gguf_loader import load_llama_gguf, read_gguf
        from hisparse.models.tokenizer import GgufTokenizer

        config = hs.resolve(model_top_k=DEFAULT_GQA_TOP_K)
        # One parse of the metadata for the weights and the tokenizer (the vocabulary's
        # strings are most of a load's host time).
        gf = read_gguf(path)
        model = load_llama_gguf(
            gf,
            dtype=dtype,
            device=device,
            indexer=GqaIndexerConfig(top_k=config.top_k, method=indexer_method(indexer)),
        )
        if device.type == "cuda":  # stacked projections, the rotary table
            model.prepare_fused()
        tokenizer = GgufTokenizer.from_gguf(gf)
        kv_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(kv_format, dtype)
        return LoadedModel(
            model, config, tokenizer, tokenizer.template, set(tokenizer.stop_token_ids),
            model.config.row_format(kv_dtype), model.config.max_position_embeddings,
        )  # fmt: skip
    from hisparse.models.loader import load_dsa_model

    rank, world = (tp.rank, tp.world_size) if tp is not None else (0, 1)
    model = load_dsa_model(
        path,
        dtype=dtype,
        device=device,
        indexer_mode=indexer,
        rank=rank,
        world=world,
        tp=tp,
        experts=experts,
    )
    if device.type == "cuda":  # the fused ops' state, once the weights sit where they run
        model.prepare_fused()
    mcfg = model.config
    config = hs.resolve(model_top_k=mcfg.index_topk)
    if config.top_k != mcfg.index_topk:
        # The sparse-attention budget applies to both placements alike.
        set_index_topk(model, config.top_k)
    return LoadedModel(
        model, config, load_tokenizer(path), chat_template_of(path, mcfg), eos_ids(path, mcfg),
        dsa_row_format(mcfg, kv_format, dtype, device), mcfg.max_position_embeddings,
    )  # fmt: skip


def chat_template_of(path: Path, mcfg: Any) -> Any:
    """The checkpoint's chat template (`load_chat_template`); without one, DeepSeek-V3.2's
    built-in encoder (its release ships none: `deepseek_chat.DeepSeekV32Encoder`)."""
    from hisparse.models.tokenizer import load_chat_template

    template = load_chat_template(path)
    if template is None and getattr(mcfg, "arch", None) == "deepseek_v32":
        from hisparse.models.deepseek_chat import DeepSeekV32Encoder

        return DeepSeekV32Encoder()
    return template


_ROW_FORMAT_ENUM = {"fp8_ds_mla": RowFormat.FP8_DS_MLA, "bf16": RowFormat.BF16_MLA}


def engine_specs(
    model: torch.nn.Module,
    row_format: object,
    block_size: int,
    placement: str = "gpu",
    spec: SpeculativeConfig | None = None,
) -> list[LayerCacheSpec]:
    """Cache specs of ``model`` with the row sizes it really writes.

    DSA models: MLA rows (any row format, fp32 included) and an indexer cache on every full
    indexer layer; IndexShare followers name their leader; with ``spec`` of method ``"mtp"``
    the checkpoint's multi-token-prediction layer after them (its own index group, with an
    indexer: `SpeculativeConfig.mtp_layers`).
    GQA models (Llama): K+V rows and a compact key cache on every layer (index groups of one).
    DeepSeek-V4: `v4_specs`.
    """
    mtp = SpeculativeConfig.mtp_layers(spec, model)  # refuses a model without the layer
    if isinstance(model, DeepseekV4ForCausalLM):
        size = model.head.weight.element_size()
        return v4_specs(model.config, size, block_size, placement)
    if isinstance(model, DsaForCausalLM):
        return dsa_specs(model.config, row_format, model.indexer_mode, block_size, mtp)
    row = row_format.row_bytes  # type: ignore[attr-defined]
    full_layers = [True] * model.config.num_hidden_layers  # type: ignore[union-attr]
    idx_row = model.indexer_format.row_bytes  # type: ignore[union-attr]
    return _layer_specs(full_layers, row, RowFormat.GQA, idx_row, block_size)


def dsa_specs(
    cfg: Any, row_format: object, indexer_mode: str, block_size: int, mtp: int = 0
) -> list[LayerCacheSpec]:
    """A DSA model's cache specs from its config alone (what `engine_specs` gives the loaded
    model; ``mtp``: the MTP layers run): a parallel engine's driver plans with them before
    any rank loads it."""
    row = mla_row_bytes(row_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim)  # type: ignore[arg-type]
    idx_row = IndexerCacheFormat.for_mode(indexer_mode, cfg.index_head_dim).row_bytes
    fmt = _ROW_FORMAT_ENUM.get(str(row_format))
    return _layer_specs(list(cfg.indexer_full) + [True] * mtp, row, fmt, idx_row, block_size)


def _layer_specs(
    full_layers: list[bool], row: int, fmt: Any, idx_row: int, block_size: int
) -> list[LayerCacheSpec]:
    """A sparse cache per layer and an indexer cache on each full indexer layer (IndexShare
    followers name their leader)."""
    specs: list[LayerCacheSpec] = []
    leader = ""
    for i, full in enumerate(full_layers):
        name = f"layers.{i}.attn"
        leader = name if full else leader
        specs.append(LayerCacheSpec(name, CacheKind.SPARSE, row, block_size, fmt, leader))
        if full:
            specs.append(
                LayerCacheSpec(f"layers.{i}.indexer", CacheKind.INDEXER, idx_row, block_size)
            )
    return specs


def v4_specs(cfg: V4Config, size: int, block_size: int, placement: str) -> list[LayerCacheSpec]:
    """DeepSeek-V4's caches (docs/design.md §20.2). All-GPU: one sparse cache per layer, a row
    per token holding its window row and entry columns (`v4_cache.row_layout`). HiSparse: a
    compressed sparse layer's entries are a sparse cache of their own (host pool, hot buffer;
    its own index group), an HCA or CSA layer's other entries a GPU-resident cache of the
    ``indexer`` kind (`v4_cache.hisparse_row_layout`), which every step reads whole, and the
    window rows a ring per request slot (`v4_cache.SlotState`, outside the pools). ``size``:
    bytes of a value (the model dtype's)."""
    if placement != "hisparse":
        return [
            LayerCacheSpec(
                f"layers.{i}.attn", CacheKind.SPARSE, row_values(cfg, i) * size, block_size
            )
            for i in range(cfg.num_hidden_layers)
        ]
    # the sparse caches first (the planner lays out from the first sparse group)
    specs = [
        LayerCacheSpec(
            f"layers.{i}.attn",
            CacheKind.SPARSE,
            cfg.head_dim * size,
            block_size,
            index_leader=f"layers.{i}.attn",
        )
        for i, kind in enumerate(cfg.layer_types)
        if kind == CSA
    ]
    for i in range(cfg.num_hidden_layers):
        gpu = sum(w for _, w in hisparse_row_layout(cfg, i).values()) * size
        if gpu:  # a window-only layer keeps nothing per token (its window is a ring)
            spec = LayerCacheSpec(f"layers.{i}.indexer", CacheKind.INDEXER, gpu, block_size)
            specs.append(spec)
    return specs
