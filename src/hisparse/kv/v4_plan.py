"""Per-request cache bytes of DeepSeek-V4 by group and placement (``hisparse plan`` for V4).

A V4 request caches five kinds of rows per layer (`hisparse.models.v4_cache`): the sliding
window's K=V rows, the compressed sparse (CSA) layers' entries (one per ``rate`` tokens), their
indexer's keys, the heavily compressed (HCA) layers' entries, and the compressors' carried state
(a ring of the last one or two windows' projections). Three layouts are counted:

* ``engine``: what the engine's all-GPU placement allocates today: one pool row per token and
  layer holding the window row and, at the row of a window's last token, the entries
  (`v4_cache.row_layout`), plus the carried state per request slot;
* ``gpu``: the compact all-GPU layout (a window ring of ``sliding_window`` rows, entry pools of
  ``len / rate`` rows), what vLLM and SGLang keep;
* ``hisparse``: the design's HiSparse layout (docs/design.md §20.1): the CSA entries in the pinned
  host pool and a hot buffer of ``device_buffer_size`` entries per request and CSA layer on the
  GPU; window, carried state, HCA entries and indexer keys on the GPU (the indexer scores every
  entry each step, as DSA's indexer keys stay on the GPU);
* ``hisparse-engine``: what the engine's HiSparse placement allocates today (§20.2): a
  window ring of ``sliding_window`` rows per layer and request slot, the HCA entries and the
  CSA indexer's spread over their windows' token rows (whole pages) on the GPU; the CSA
  entries keyed by token row in the host pool (every page and a copy-on-write tail, as
  admission reserves them), their last three pages resident and the hot buffer in whole
  pages on the GPU.

Rows are counted in the engine's row dtype (``value_bytes``: 2 for bf16, the model dtype on
GPUs); the release's own fp8/fp4 cache formats are not built. Every rank of a tensor-parallel
group holds the whole rows (`hisparse.parallel.shard_v4` splits heads, not rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hisparse.config import HiSparseConfigError
from hisparse.kv.layout import RESIDENT_PEAK_PAGES
from hisparse.models.v4_cache import row_values, spread_width, state_ring
from hisparse.models.v4_config import CSA, HCA, V4Config

#: DeepSeek-V4-Flash's config.json as published (also pinned in tests/test_models_v4.py).
_FLASH = dict(
    model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, index_n_heads=64,
    index_head_dim=128, index_topk=512, sliding_window=128, vocab_size=129280,
    max_position_embeddings=1048576, num_hash_layers=3,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
)  # fmt: skip
#: DeepSeek-V4-Pro's dimensions as public descriptions of its config.json give them (61 layers,
#: hidden 7168, 128 heads of 512, 16 output groups, 384 experts of width 3072, top-k 1024,
#: layers 0-1 HCA then CSA/HCA interleaved: transformers' default schedule); not read from the
#: release's file.
_PRO = dict(
    _FLASH, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
    o_groups=16, moe_intermediate_size=3072, n_routed_experts=384, index_topk=1024,
    compress_ratios=None,
)  # fmt: skip
V4_PRESETS: dict[str, dict[str, Any]] = {"deepseek-v4-flash": _FLASH, "deepseek-v4-pro": _PRO}
#: Placements `request_bytes` counts (module docstring).
V4_PLACEMENTS = ("engine", "gpu", "hisparse", "hisparse-engine")
#: Group names, in the order tables print them.
GROUPS = (
    "sliding window rows",
    "CSA entries",
    "indexer keys",
    "HCA entries",
    "compressor state",
    "CSA hot buffer",
)


def v4_config_of(model: str | Path) -> V4Config | None:
    """The V4 configuration of a plan preset or a ``deepseek_v4`` config.json; None for any
    other model (the DSA planner's)."""
    if isinstance(model, str) and model in V4_PRESETS:
        cfg = {k: v for k, v in V4_PRESETS[model].items() if v is not None}
        return V4Config.from_dict(cfg)
    p = Path(model)
    p = p / "config.json" if p.is_dir() else p
    if p.suffix != ".json" or not p.is_file():
        return None
    import json

    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "deepseek_v4":
        return None
    return V4Config.from_dict(cfg)


@dataclass(frozen=True)
class GroupBytes:
    """One group's bytes per request: on the GPU and in the host pool."""

    name: str
    gpu: int
    host: int


def request_bytes(
    config: V4Config,
    context_len: int,
    placement: str,
    *,
    value_bytes: int = 2,
    block_size: int = 64,
    device_buffer_size: int | None = None,
) -> list[GroupBytes]:
    """Bytes of one request of ``context_len`` tokens, by group (`GROUPS`), in ``placement``.

    ``engine`` and ``hisparse-engine`` count whole pages of ``block_size`` tokens as the
    engine allocates them (rows interleave window and entries, reported under the window group
    and the entry groups by their columns); ``device_buffer_size``: hot entries per request
    and CSA layer (default ``2 * index_topk``, the DSA default for decode:
    ``(max_query_len + 1) * top_k``).
    """
    if placement not in V4_PLACEMENTS:
        raise HiSparseConfigError(f"placement {placement!r}: expected one of {V4_PLACEMENTS}")
    if context_len < 1:
        raise HiSparseConfigError(f"context length {context_len} must be >= 1")
    vb, d, di = value_bytes, config.head_dim, config.index_head_dim
    buf = 2 * config.index_topk if device_buffer_size is None else device_buffer_size
    pages = math.ceil(context_len / block_size)
    per_token = placement in ("engine", "hisparse-engine")
    tokens = pages * block_size if per_token else None
    acc = dict.fromkeys(GROUPS, (0, 0))

    def add(group: str, gpu: int = 0, host: int = 0) -> None:
        g, h = acc[group]
        acc[group] = (g + gpu, h + host)

    for layer, kind in enumerate(config.layer_types):
        rate = config.compress_rate(layer)
        if placement == "engine":  # the engine: a row per token and layer
            add("sliding window rows", tokens * d * vb)
        elif placement == "hisparse-engine":  # a ring per request slot, allocated whole
            add("sliding window rows", config.sliding_window * d * vb)
        else:
            add("sliding window rows", min(context_len, config.sliding_window) * d * vb)
        if not rate:
            continue
        # the carried state: kv and gate rings of the compressor (and the indexer's on CSA)
        widths = [d] + ([di] if kind == CSA else [])
        series = 2 if kind == CSA else 1
        add(
            "compressor state", sum(2 * state_ring(config, layer) * w * series for w in widths) * vb
        )
        # the engine: the entry columns of every row; else one row per closed window
        entry_rows = tokens if tokens is not None else context_len // rate
        entries = entry_rows * d * vb
        # HiSparse as built: an HCA or indexer entry spread over its window's token rows
        spread = placement == "hisparse-engine"
        if kind == HCA:
            add("HCA entries", entry_rows * spread_width(d, rate) * vb if spread else entries)
            continue
        add("indexer keys", entry_rows * (spread_width(di, rate) if spread else di) * vb)
        if placement == "hisparse-engine":  # the layout's resident and hot group pages
            tail = min(RESIDENT_PEAK_PAGES, pages) * block_size
            add("CSA entries", tail * d * vb, host=(pages + 1) * block_size * d * vb)
            add("CSA hot buffer", math.ceil(buf / block_size) * block_size * d * vb)
        elif placement == "hisparse":
            add("CSA entries", host=entries)
            add("CSA hot buffer", min(buf, entry_rows) * d * vb)
        else:
            add("CSA entries", entries)
    if placement == "engine":  # every row has the width of its layer's row_values
        rows = sum(row_values(config, i) for i in range(config.num_hidden_layers))
        assert sum(g for name, (g, _) in acc.items() if name != "compressor state") == (
            tokens * rows * vb
        )
    return [GroupBytes(name, g, h) for name, (g, h) in acc.items()]


def totals(groups: list[GroupBytes]) -> tuple[int, int]:
    """(GPU bytes, host bytes) of one request."""
    return sum(g.gpu for g in groups), sum(g.host for g in groups)


def requests_that_fit(
    groups: list[GroupBytes], gpu_budget: int, host_budget: int | None = None
) -> int:
    """Requests whose bytes fit ``gpu_budget`` (and ``host_budget`` where given)."""
    gpu, host = totals(groups)
    fit = gpu_budget // gpu if gpu else 0
    if host and host_budget is not None:
        fit = min(fit, host_budget // host)
    return max(fit, 0)


def _fp8(out_dim: int, in_dim: int) -> int:
    """e4m3 weights plus the engine's fp32 factor per 128 x 128 tile."""
    return out_dim * in_dim + 4 * math.ceil(out_dim / 128) * math.ceil(in_dim / 128)


def weight_bytes_per_rank(config: V4Config, tp: int = 1) -> tuple[int, int]:
    """(parameters of the whole model, bytes on the widest rank of ``tp``): an estimate in the
    release's formats as the engine holds them — routed experts 4-bit (e2m1 plus one
    UE8M0 byte per 32 values), the other linear weights e4m3 with fp32 tile factors, ``wo_a``
    dequantized to bf16, embedding, LM head and norms bf16, router and hyper-connection mixers
    fp32. Sharded as `hisparse.parallel.shard_v4` shards (``wq_b``, ``wo_a`` by output group,
    ``wo_b`` by input, expert widths); the LM head on rank 0 only. The MTP layer, which the
    engine does not load, is not counted."""
    h, H, d = config.hidden_size, config.num_attention_heads, config.head_dim
    ql, olr, g = config.q_lora_rank, config.o_lora_rank, config.o_groups
    E, S, Ie = config.n_routed_experts, config.n_shared_experts, config.moe_intermediate_size
    hi, di, hc, V = config.index_n_heads, config.index_head_dim, config.hc_mult, config.vocab_size
    for what, size in (("attention heads", H), ("output groups (o_groups)", g),
                       ("expert width (moe_intermediate_size)", Ie)):  # fmt: skip
        if size % tp:
            raise HiSparseConfigError(
                f"--tensor-parallel-size {tp} does not divide the model's {size} {what}"
            )
    params = nbytes = 0
    mix = (2 + hc) * hc * hc * h  # hc_*_fn of attention and of the FFN: [(2+hc)·hc, hc·h]
    for layer, kind in enumerate(config.layer_types):
        p = (h * ql + ql * H * d + h * d + olr * H * d + h * g * olr + 2 * mix + E * h + E
             + ql + d + 2 * h + H)  # fmt: skip
        b = (_fp8(ql, h) + _fp8(H * d // tp, ql) + _fp8(d, h) + 2 * olr * H * d // tp
             + _fp8(h, g * olr // tp) + 4 * 2 * mix + 4 * (E * h + E) + 2 * (ql + d + 2 * h)
             + 4 * H // tp)  # fmt: skip
        p += E * 3 * h * Ie + S * 3 * h * Ie
        b += E * 3 * (h * Ie // tp) * 17 // 32 + S * (2 * _fp8(Ie // tp, h) + _fp8(h, Ie // tp))
        if config.compress_rate(layer):
            series = 2 if kind == CSA else 1
            p += 2 * h * d * series + d
            b += 2 * _fp8(d * series, h) + 2 * d
            if kind == CSA:  # the indexer: wq_b, weights_proj, its compressor
                p += ql * hi * di + h * hi + 2 * h * di * 2 + di
                b += _fp8(hi * di, ql) + 4 * h * hi + 2 * _fp8(2 * di, h) + 2 * di
        params += p
        nbytes += b
    params += 2 * V * h + h
    nbytes += 2 * 2 * V * h + 2 * h  # embedding and the LM head (rank 0) whole, bf16
    return params, nbytes
