"""Training-free indexer for GQA/MHA layers: one top-k per query token and layer.

A GQA model has no trained indexer, so the selection approximates the attention itself from a
compact copy of the keys that stays on the GPU (at most a quarter of a KV row's bytes per
token). Three scoring methods share one selection rule:

- ``fp8``: every key of every KV head as **unscaled, saturating e4m3** (``G·D`` bytes: exactly a
  quarter of a bf16 row; a per-token scale would not fit). e4m3 is a float, so relative
  precision (3 mantissa bits) does not depend on a scale; only magnitudes outside
  ``[2^-9, 448]`` suffer, and such tiny components add nothing to a dot product while keys of
  RoPE Llama models stay far below 448 (SmolLM2: ``|k| < 30``).
- ``quest``: Quest-style page bounds. Per chunk of ``quest_chunk`` consecutive positions (must
  divide the block size; chunk borders are logical, so placement does not matter) the
  element-wise min and max of the keys, fp32 (``8·G·D / chunk`` B per token: 96 B for SmolLM2 at
  chunk 16). A chunk's score is the upper bound ``Σ_d max(q_d·min_d, q_d·max_d)``; its tokens
  share it, so whole chunks are chosen.
- ``lowrank``: the ``lowrank_pairs`` rotary pairs (dims ``i`` and ``i + D/2``, which RoPE only
  rotates together, so a pair's contribution to ``q·k`` survives any position) of each KV head
  whose weight energy ``‖W_q pair‖·‖W_k pair‖`` is largest, stored as fp16. Chosen from the
  weights at load time; no calibration data.

Selection, common to all: per query head, a softmax over the candidate keys of the scaled
approximate logits; the scores of a token are the attention **mass** summed over all query
heads (dropping the tokens of least total mass bounds the mass every head loses). The first
``sink_tokens`` positions and the last ``recent_window`` positions up to the query are always
kept and are left out of the softmax, so whatever they hold cannot move the choice among the
others (in particular: a prefill and token-by-token decoding choose the same rows). The result
lists positions ascending, ``-1`` padded. With ``top_k`` at least the context length every
earlier position is chosen: attention is then exactly dense. (A batch-1 fp8 decode on the CPU
scores in one compiled call, `gqa_indexer_cpu`: the same rule, sums rounded in another
order, so a near-tie at the top-k border may fall the other way than in a prefill. A CPU
prefill scores by chunked matmuls and one compiled pass per query, `_topk_prefill_cpu`.)

Default ``fp8``, by measurement: of the three it stays closest to dense attention in
perplexity and top-1 agreement on SmolLM2 (docs/quality.md, the indexer's scoring method). fp8
also reads the fewest bytes per useful bit of scoring and needs no weight-derived state.

Here: the config, the compact cache's format and the top-k of a request, of a packed step and
of a decode step. The compact key cache itself (its writes and reads, the lowrank method's
kept dims) is `gqa_indexer_keys`; each method's approximate logits and the selection rule
`gqa_indexer_select`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hisparse.attention.gqa_indexer_cpu import cpu_compiled, fp8_topk_one_cpu, scored_topk_cpu
from hisparse.attention.gqa_indexer_keys import _fp8_to_float, read_index_keys
from hisparse.attention.gqa_indexer_select import (
    SelectionMasks,
    approx_logits,
    dense_rows,
    dense_topk,
    select_topk,
)

INDEXER_METHODS = ("fp8", "quest", "lowrank")
#: Upper bound on the fp32 elements of one ``[T, H, S]`` score chunk.
_CHUNK_ELEMENTS = 1 << 25
#: The same bound on the CPU, where chunks that fit in the cache run faster.
_CPU_CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class GqaIndexerConfig:
    """How a GQA model chooses its rows. ``top_k=None`` attends to every earlier token."""

    top_k: int | None = None
    method: str = "fp8"
    sink_tokens: int = 4
    recent_window: int = 64
    quest_chunk: int = 16
    lowrank_pairs: int = 8

    def __post_init__(self) -> None:
        if self.method not in INDEXER_METHODS:
            raise ValueError(f"indexer method {self.method!r}: expected one of {INDEXER_METHODS}")
        if self.sink_tokens < 0 or self.recent_window < 1:
            raise ValueError("sink_tokens must be >= 0 and recent_window >= 1 (the token itself)")
        floor = self.sink_tokens + self.recent_window
        if self.top_k is not None and self.top_k < floor:
            from hisparse.validation import HiSparseConfigError

            # field and example: the CLI names its flag (--sparse-top-k) and a value that works
            need = f">= sink_tokens + recent_window = {floor} (the rows a GQA indexer always keeps)"
            raise HiSparseConfigError(
                f"top_k={self.top_k} is smaller than sink_tokens + recent_window = {floor}; "
                f"raise top_k (e.g. top_k={max(256, floor)}) or shrink the window",
                field="HiSparseConfig.top_k", value=self.top_k, requirement=need,
                example=max(256, floor),
            )  # fmt: skip
        if self.method == "quest" and self.recent_window < self.quest_chunk:
            raise ValueError(
                f"quest needs recent_window >= quest_chunk ({self.quest_chunk}) so a query's own, "
                "partly written chunk is always kept rather than scored"
            )


@dataclass(frozen=True)
class GqaIndexerFormat:
    """Bytes of the compact key cache of one layer (pages ``[NB, page_bytes(BS)]`` uint8)."""

    method: str
    num_kv_heads: int
    head_dim: int
    quest_chunk: int = 16
    lowrank_pairs: int = 8

    @classmethod
    def for_config(cls, cfg: GqaIndexerConfig, num_kv_heads: int, head_dim: int):
        return cls(cfg.method, num_kv_heads, head_dim, cfg.quest_chunk, cfg.lowrank_pairs)

    @property
    def key_dim(self) -> int:
        """Values kept per KV head and token (fp8: all; lowrank: the chosen pairs)."""
        return 2 * self.lowrank_pairs if self.method == "lowrank" else self.head_dim

    @property
    def chunk_bytes(self) -> int:
        """quest: bytes of one chunk's bounds (fp32 min then fp32 max of every value)."""
        return 8 * self.num_kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes per token (quest: its share of a chunk)."""
        g = self.num_kv_heads
        if self.method == "fp8":
            return g * self.head_dim
        if self.method == "lowrank":
            return 2 * g * self.key_dim
        return self.chunk_bytes // self.quest_chunk

    def page_bytes(self, block_size: int) -> int:
        if self.method == "quest" and block_size % self.quest_chunk:
            raise ValueError(
                f"block size {block_size} is not a multiple of quest_chunk {self.quest_chunk}"
            )
        return block_size * self.row_bytes

    def block_size_of(self, pages: torch.Tensor) -> int:
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] % self.row_bytes:
            raise ValueError(
                f"{self.method} index pages must be uint8 [num_blocks, block_size * "
                f"{self.row_bytes}]; got {pages.dtype} {tuple(pages.shape)}"
            )
        return pages.shape[1] // self.row_bytes


def gqa_indexer_topk(
    q: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    length: int,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None = None,
    masks: SelectionMasks | None = None,
) -> torch.Tensor:
    """Logical top-k ``int32 [T, width]`` of one request's queries ``q [T, H, D]``.

    The request holds ``length`` keys, read from ``pages`` through its block-table row
    ``table``. A request that fits in ``top_k`` skips the scoring (dense). ``masks``: the
    `selection_masks` of all ``positions`` (a decode step builds them once for all layers).
    """
    if cfg.top_k is None or length <= cfg.top_k:
        return dense_topk(positions, width)
    if q.shape[0] == 1 and q.device.type == "cpu" and fmt.method == "fp8":
        chosen = fp8_topk_one_cpu(q, positions, pages, table, length, fmt, cfg, scale, width)
        if chosen is not None:
            return chosen
    if q.shape[0] > 1:
        # A prefill's tokens before position top_k have at most top_k candidates: they keep
        # every one of them (what scoring would choose too), so only later tokens are scored.
        late = torch.nonzero(positions >= cfg.top_k).flatten()
        if late.numel() < q.shape[0]:
            out = dense_topk(positions, width)
            if late.numel():
                out[late] = gqa_indexer_topk(
                    q[late], positions[late], pages, table, length, fmt, cfg, scale, width, dims
                )
            return out
    keys = read_index_keys(pages, fmt, table, length)
    if q.shape[0] > 1 and q.device.type == "cpu":
        chosen = scored_topk_cpu(q, positions, keys, fmt, cfg, scale, width, dims)
        if chosen is not None:
            return chosen
    h = q.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, h * length))
    out = []
    for lo in range(0, q.shape[0], step):
        hi = min(q.shape[0], lo + step)
        logits = approx_logits(q[lo:hi], keys, fmt, scale, dims)
        whole = masks if lo == 0 and hi == q.shape[0] else None
        out.append(select_topk(logits, positions[lo:hi], length, cfg, width, whole))
    return out[0] if len(out) == 1 else torch.cat(out)


def _topk_prefill_cpu(
    q: torch.Tensor,
    positions: torch.Tensor,
    req_index: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[int],
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None,
) -> torch.Tensor:
    """`gqa_indexer_topk_prefill` on the CPU with numba: the dense rows and the scored
    tokens in one compiled call (`dense_rows` kernel), then each request's scored tokens
    through `gqa_indexer_topk` (`gqa_indexer_cpu.scored_topk_cpu`): what a dozen torch passes
    ``[N, width]`` did."""
    from hisparse.runtime.ops import cpu_backend

    fns = cpu_backend().jit()
    assert fns is not None
    n = q.shape[0]
    out = torch.empty(n, width, dtype=torch.int32)
    scored = torch.empty(n, dtype=torch.bool)
    top_k = -1 if cfg.top_k is None else cfg.top_k
    fns.dense_rows(
        positions.contiguous().numpy(), req_index.contiguous().numpy(),
        np.asarray(lengths, dtype=np.int64), top_k, out.numpy(), scored.numpy(),
    )  # fmt: skip
    tok = torch.nonzero(scored).flatten()
    if tok.numel() == 0:
        return out
    req = req_index[tok]
    for r in torch.unique(req).tolist():
        part = tok if len(lengths) == 1 else tok[req == r]
        out[part] = gqa_indexer_topk(
            q[part], positions[part], pages, tables[r], lengths[r], fmt, cfg, scale, width, dims
        )
    return out


def pad_groups(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups, most members]`` indices of the items of each group, in item order,
    ``-1`` padded; ``group [N]`` names each item's group (``< 0``: none). One host read."""
    valid = group >= 0
    key = torch.where(valid, group, num_groups)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(group[valid], minlength=num_groups)
    width = int(counts.max()) if num_groups and group.numel() else 0
    out = torch.full((num_groups, width), -1, dtype=torch.long, device=group.device)
    n_valid = int(counts.sum()) if num_groups else 0
    if n_valid == 0:
        return out
    members = order[:n_valid]
    g = key[members]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n_valid, device=group.device) - first[g]
    out[g, rank] = members
    return out


def gqa_indexer_topk_prefill(
    q: torch.Tensor,
    positions: torch.Tensor,
    req_index: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[int],
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logical top-k ``int32 [N, width]`` of a packed multi-token step (prefill chunks, mixed
    decode rows): token ``i`` belongs to request ``req_index[i]`` (``< 0``: padding, selects
    nothing), which holds ``lengths[r]`` keys through block-table row ``tables[r]``.

    The rule of `gqa_indexer_topk` (requests that fit in ``top_k`` and tokens before position
    ``top_k`` are dense), but the scored tokens of all requests go through one batched scoring
    (keys padded to the longest scored request, hidden by the causal mask) instead of one
    pass per request. quest (per-chunk keys) goes request by request.
    """
    if cpu_compiled(q, fmt):
        return _topk_prefill_cpu(
            q, positions, req_index, pages, tables, lengths, fmt, cfg, scale, width, dims
        )
    valid = req_index >= 0
    out = torch.where(valid[:, None], dense_topk(positions, width), -1)
    top_k = cfg.top_k
    if top_k is None or max(lengths, default=0) <= top_k:
        return out
    lens_d = torch.tensor(lengths, device=q.device)
    req = req_index.clamp_min(0)
    scored = valid & (lens_d[req] > top_k) & (positions >= top_k)
    if fmt.method == "quest":  # request by request
        for r, length in enumerate(lengths):
            tok = torch.nonzero(scored & (req_index == r)).flatten()
            if length > top_k and tok.numel():
                out[tok] = gqa_indexer_topk(
                    q[tok], positions[tok], pages, tables[r], length, fmt, cfg, scale,
                    width, dims,
                )  # fmt: skip
        return out
    sreq = [r for r, length in enumerate(lengths) if length > top_k]
    remap = torch.full((len(lengths),), -1, dtype=torch.long, device=q.device)
    remap[torch.tensor(sreq, device=q.device)] = torch.arange(len(sreq), device=q.device)
    group = torch.where(scored, remap[req], -1)
    padded = pad_groups(group, len(sreq))  # [S, T] token indices
    if padded.shape[1] == 0:
        return out
    longest = max(lengths[r] for r in sreq)
    bs = fmt.block_size_of(pages)
    nb = -(-longest // bs)
    h = q.shape[1]
    g = fmt.num_kv_heads
    t_all = padded.shape[1]
    # CPU: score chunks that stay in the cache through select_topk's passes over them.
    limit = _CPU_CHUNK_ELEMENTS if q.device.type == "cpu" else _CHUNK_ELEMENTS
    t_step = max(1, min(t_all, limit // max(1, h * longest)))
    r_step = max(1, limit // max(1, h * longest * t_step))
    sreq_d = torch.tensor(sreq, device=q.device)
    for r0 in range(0, len(sreq), r_step):
        r1 = min(len(sreq), r0 + r_step)
        blocks = tables[sreq_d[r0:r1], :nb].long().reshape(-1)
        raw = pages.index_select(0, blocks).view(r1 - r0, nb * bs, fmt.row_bytes)[:, :longest]
        if fmt.method == "fp8":
            keys = _fp8_to_float(raw)
        else:
            keys = raw.contiguous().view(torch.float16).float()
        keys = keys.view(r1 - r0, longest, g, fmt.key_dim)
        for lo in range(0, t_all, t_step):
            tok = padded[r0:r1, lo : lo + t_step]  # [r, t]
            m = tok.shape[1]
            safe = tok.clamp_min(0)
            qg = q[safe].float().view(r1 - r0, m, g, h // g, -1)
            if fmt.method == "lowrank":
                assert dims is not None
                idx = dims.to(q.device)[None, None, :, None, :].expand(r1 - r0, m, -1, h // g, -1)
                qg = torch.gather(qg, 4, idx)
            logits = torch.einsum("rtgqd,rsgd->rtgqs", qg, keys).reshape(-1, h, longest) * scale
            pos = torch.where(tok >= 0, positions[safe], -1).reshape(-1)
            chosen = select_topk(logits, pos, longest, cfg, width)
            live = tok.reshape(-1) >= 0
            out[tok.reshape(-1)[live]] = chosen[live]
    return out


def gqa_indexer_topk_decode_reference(
    q: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    longest: int,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logical top-k ``int32 [R, width]`` of a decode step: request ``r`` has one query
    ``q[r]`` at ``positions[r]``, ``lengths[r]`` keys (device tensor) and block-table row
    ``tables[r]``; ``longest`` is a host bound on ``lengths`` (the longest request, or any
    larger bound such as the block table's capacity).

    The same selection rule as `gqa_indexer_topk`, scored for all requests at once (keys padded
    to ``longest``; the causal mask hides the padding, NaN garbage of unwritten pages too),
    instead of a dozen small ops per request: what makes batch-64 decode affordable on a GPU.
    Requests that fit in ``top_k`` are dense. No host read (CUDA-graph capturable), except for
    quest (per-chunk keys), which goes request by request.
    """
    r, h, _ = q.shape
    dense = dense_rows(positions, lengths, width)
    if cfg.top_k is None or longest <= cfg.top_k:
        return dense
    if fmt.method == "quest":
        lens = lengths.tolist()
        return torch.cat([
            gqa_indexer_topk(q[i : i + 1], positions[i : i + 1], pages, tables[i], lens[i],
                             fmt, cfg, scale, width, dims) if lens[i] > 0 else dense[i : i + 1]
            for i in range(r)
        ])  # fmt: skip
    bs = fmt.block_size_of(pages)
    nb = -(-longest // bs)
    per_req = longest * (h + fmt.num_kv_heads * fmt.key_dim)
    step = max(1, _CHUNK_ELEMENTS // max(1, per_req))
    out = []
    for lo in range(0, r, step):
        hi = min(r, lo + step)
        blocks = tables[lo:hi, :nb].long().reshape(-1)
        raw = pages.index_select(0, blocks).view(hi - lo, nb * bs, fmt.row_bytes)[:, :longest]
        if fmt.method == "fp8":
            keys = _fp8_to_float(raw)
        else:
            keys = raw.contiguous().view(torch.float16).float()
        keys = keys.view(hi - lo, longest, fmt.num_kv_heads, fmt.key_dim)
        qg = q[lo:hi].float().view(hi - lo, fmt.num_kv_heads, h // fmt.num_kv_heads, -1)
        if fmt.method == "lowrank":
            assert dims is not None
            idx = dims.to(q.device)[None, :, None, :].expand(hi - lo, -1, qg.shape[2], -1)
            qg = torch.gather(qg, 3, idx)
        logits = torch.einsum("rgqd,rsgd->rgqs", qg, keys).reshape(hi - lo, h, -1) * scale
        out.append(select_topk(logits, positions[lo:hi], longest, cfg, width))
    chosen = torch.cat(out)
    return torch.where((lengths <= cfg.top_k)[:, None], dense, chosen)
