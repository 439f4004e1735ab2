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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hisparse.attention.gqa_indexer_cpu import cpu_compiled, fp8_topk_one_cpu, scored_topk_cpu
from hisparse.kv.row_formats import fp8_values

INDEXER_METHODS = ("fp8", "quest", "lowrank")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
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
        if self.top_k is not None and self.top_k < self.sink_tokens + self.recent_window:
            raise ValueError(
                f"top_k={self.top_k} is smaller than sink_tokens + recent_window = "
                f"{self.sink_tokens + self.recent_window}; raise top_k or shrink the window"
            )
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


def rope_pair_dims(
    wq: torch.Tensor, wk: torch.Tensor, num_heads: int, num_kv_heads: int, pairs: int
) -> torch.Tensor:
    """``[G, 2·pairs]`` dims (ascending) of each KV head that the ``lowrank`` method keeps.

    Pair ``i`` (dims ``i``, ``i + D/2``) is ranked by ``Σ_{h in group} ‖W_q,h pair‖ · ‖W_k pair‖``,
    the scale of its contribution to ``q·k`` for unit-norm inputs.
    """
    g = num_kv_heads
    d = wk.shape[0] // g
    half = d // 2
    if not 0 < pairs <= half:
        raise ValueError(f"lowrank_pairs must be in 1..{half}; got {pairs}")
    q_rows = wq.float().view(num_heads, d, -1).pow(2).sum(-1)  # [H, D]
    k_rows = wk.float().view(g, d, -1).pow(2).sum(-1)  # [G, D]
    q_pair = (q_rows[:, :half] + q_rows[:, half:]).sqrt().view(g, num_heads // g, half).sum(1)
    k_pair = (k_rows[:, :half] + k_rows[:, half:]).sqrt()
    best = (q_pair * k_pair).topk(pairs, dim=-1).indices.sort(dim=-1).values  # [G, pairs]
    return torch.cat((best, best + half), dim=-1)


# ---------------------------------------------------------------------------------------------
# The compact key cache
# ---------------------------------------------------------------------------------------------
def write_index_keys(
    pages: torch.Tensor,
    fmt: GqaIndexerFormat,
    slots: torch.Tensor,
    k: torch.Tensor,
    dims: torch.Tensor | None = None,
    *,
    sync_free: bool = False,
) -> None:
    """Store keys ``k [N, G, D]`` (rotated) of the tokens at physical ``slots`` (``< 0`` skipped).

    quest: a token at the first position of its chunk restarts the chunk's bounds, later ones
    widen them; tokens of one step may share a chunk. ``sync_free`` (fp8 / lowrank): write
    with `write_rows_fast` (same bytes; off the CPU `write_rows_where`: no host read,
    CUDA-graph capturable).
    """
    fmt.block_size_of(pages)  # validates the page shape
    if sync_free and fmt.method != "quest":
        from hisparse.kv.row_formats import write_rows_fast

        kf = k.float()
        if fmt.method == "fp8":
            row = kf.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(1).view(torch.uint8)
        else:
            if dims is None:
                raise ValueError("lowrank index keys need the kept dims")
            picked = torch.gather(kf, 2, dims[None].expand(k.shape[0], -1, -1).to(k.device))
            row = picked.to(torch.float16).flatten(1).view(torch.uint8)
        write_rows_fast(_row_view(pages, fmt.row_bytes), slots, row)
        return
    keep = slots >= 0
    slots, k = slots[keep].long(), k[keep].float()
    if slots.numel() == 0:
        return
    bs = fmt.block_size_of(pages)
    rows = _row_view(pages, fmt.row_bytes)
    if fmt.method == "fp8":
        rows[slots // bs, slots % bs] = (
            k.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(1).view(torch.uint8)
        )
        return
    if fmt.method == "lowrank":
        if dims is None:
            raise ValueError("lowrank index keys need the kept dims")
        picked = torch.gather(k, 2, dims[None].expand(k.shape[0], -1, -1).to(k.device))
        rows[slots // bs, slots % bs] = picked.to(torch.float16).flatten(1).view(torch.uint8)
        return
    c = fmt.quest_chunk
    per_block = bs // c
    bounds = _quest_view(pages, fmt)  # [blocks, chunks per block, 2, G·D]
    chunk = slots // c  # blocks hold bs // c whole chunks, so this is the global chunk index
    touched, local = torch.unique(chunk, return_inverse=True)
    cur = bounds[touched // per_block, touched % per_block].clone()  # [U, 2, G·D]
    lo, hi = cur[:, 0], cur[:, 1]
    fresh = local[slots % c == 0]
    lo[fresh] = float("inf")
    hi[fresh] = float("-inf")
    flat = k.flatten(1)
    index = local[:, None].expand_as(flat)
    lo.scatter_reduce_(0, index, flat, "amin", include_self=True)
    hi.scatter_reduce_(0, index, flat, "amax", include_self=True)
    bounds[touched // per_block, touched % per_block] = cur


def _row_view(pages: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``[blocks, block_size, row_bytes]`` view of pages whose blocks may be strided (the
    engine's pages are layers of a shared GPU pool: one block's page, then other groups)."""
    return pages.unflatten(1, (pages.shape[1] // row_bytes, row_bytes))


def _quest_view(pages: torch.Tensor, fmt: GqaIndexerFormat) -> torch.Tensor:
    """``[blocks, chunks per block, 2, G·D]`` fp32 bounds of every chunk of the pages."""
    bs = fmt.block_size_of(pages)
    width = 8 * fmt.num_kv_heads * fmt.head_dim
    chunks = _row_view(pages, width).view(torch.float32)
    return chunks.view(pages.shape[0], bs // fmt.quest_chunk, 2, -1)


def read_index_keys(
    pages: torch.Tensor, fmt: GqaIndexerFormat, table: torch.Tensor, length: int
) -> torch.Tensor:
    """A request's compact keys, in position order, as fp32.

    ``table`` is the request's block-table row. fp8 / lowrank: ``[length, G, key_dim]``;
    quest: ``[num_chunks, 2, G, D]`` (min, max) of chunks ``0 .. ceil(length / chunk) - 1``.
    """
    bs = fmt.block_size_of(pages)
    g = fmt.num_kv_heads
    if fmt.method == "quest":
        c = fmt.quest_chunk
        start = torch.arange(0, length, c, device=pages.device)
        blocks = table[start // bs].long()
        bounds = _quest_view(pages, fmt)[blocks, (start % bs) // c]
        return bounds.reshape(-1, 2, g, fmt.head_dim)
    # Whole pages, then the first ``length`` rows: one contiguous copy per block.
    blocks = table[: -(-length // bs)].long()
    raw = pages.index_select(0, blocks).view(-1, fmt.row_bytes)[:length]
    if fmt.method == "fp8":
        return _fp8_to_float(raw).view(length, g, fmt.key_dim)
    return raw.view(torch.float16).float().view(length, g, fmt.key_dim)


def _fp8_to_float(raw: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> fp32, exactly ``raw.view(e4m3).float()``, through a 256-entry table
    (faster on the CPU than the cast, which dominated the decode indexer)."""
    lut = fp8_values(raw.device)
    return lut.index_select(0, raw.reshape(-1).int()).view(raw.shape)


# ---------------------------------------------------------------------------------------------
# Scores and selection
# ---------------------------------------------------------------------------------------------
def approx_logits(
    q: torch.Tensor,
    keys: torch.Tensor,
    fmt: GqaIndexerFormat,
    scale: float,
    dims: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, H, S]`` approximate ``q·k·scale`` of queries ``q [T, H, D]`` against every position.

    ``keys`` is what `read_index_keys` returned; quest logits are per chunk, repeated over its
    positions (``S = chunks · chunk``; the caller masks positions past the length).
    """
    t, h, d = q.shape
    g = fmt.num_kv_heads
    qg = q.float().view(t, g, h // g, d)
    if fmt.method == "fp8":
        return torch.einsum("tgqd,sgd->tgqs", qg, keys).reshape(t, h, -1) * scale
    if fmt.method == "lowrank":
        assert dims is not None
        idx = dims.to(q.device)[None, :, None, :].expand(t, g, h // g, -1)
        qr = torch.gather(qg, 3, idx)
        return torch.einsum("tgqd,sgd->tgqs", qr, keys).reshape(t, h, -1) * scale
    lo, hi = keys[:, 0], keys[:, 1]  # [C, G, D]
    ub = torch.maximum(
        torch.einsum("tgqd,cgd->tgqcd", qg, lo), torch.einsum("tgqd,cgd->tgqcd", qg, hi)
    ).sum(-1)
    ub = ub.reshape(t, h, -1) * scale
    return ub.repeat_interleave(fmt.quest_chunk, dim=-1)


def forced_mask(
    positions: torch.Tensor, length: int, sink_tokens: int, recent_window: int
) -> torch.Tensor:
    """``[T, length]`` bool: the sink and recent-window positions each query always keeps."""
    s = torch.arange(length, device=positions.device)[None, :]
    t = positions[:, None]
    return (s <= t) & ((s < sink_tokens) | (s > t - recent_window))


@dataclass(frozen=True)
class SelectionMasks:
    """What `select_topk` derives from the query positions alone, built once per decode step
    and shared by every layer (a dozen small ops fewer per layer on the CPU).

    ``cand [T, 1, length]``: scored candidates (causal, not forced); ``base [T, length]``:
    the score of every non-candidate (``2·H`` forced, ``-1`` not causal). ``full`` (a host
    bool, checked only when asked): every query has a candidate and at least
    ``min(top_k, length)`` causal positions, so no infinite max and no padding column can
    occur and `select_topk` skips the guards for them (the same values).
    """

    length: int
    heads: int
    cand: torch.Tensor
    base: torch.Tensor
    full: bool = False


def selection_masks(
    positions: torch.Tensor, length: int, heads: int, cfg: GqaIndexerConfig, *, check: bool
) -> SelectionMasks:
    """`SelectionMasks` of queries at ``positions`` over ``length`` keys, ``heads`` query
    heads; ``check`` reads ``full`` back to the host (free on the CPU, a sync elsewhere)."""
    assert cfg.top_k is not None
    s = torch.arange(length, device=positions.device)
    causal = s[None, :] <= positions[:, None]
    forced = forced_mask(positions, length, cfg.sink_tokens, cfg.recent_window)
    cand = causal & ~forced
    base = torch.where(forced, 2.0 * heads, -1.0)
    full = False
    if check:
        kk = min(cfg.top_k, length)
        enough = (positions + 1).clamp(max=length) >= kk
        full = bool((enough & cand.any(-1)).all())
    return SelectionMasks(length, heads, cand[:, None, :], base, full)


def select_topk(
    logits: torch.Tensor,
    positions: torch.Tensor,
    length: int,
    cfg: GqaIndexerConfig,
    width: int,
    masks: SelectionMasks | None = None,
) -> torch.Tensor:
    """Positions ``int32 [T, width]`` (ascending, ``-1`` padded) from ``logits [T, H, >= length]``.

    Scores are the attention mass over query heads among non-forced candidates ``s <= t``;
    forced positions come first, then the best candidates up to ``top_k``. ``masks``: the
    `selection_masks` of these positions (built here when not given; same result).
    """
    assert cfg.top_k is not None
    t = positions.shape[0]
    if masks is None or masks.length != length or masks.heads != logits.shape[1]:
        masks = selection_masks(positions, length, logits.shape[1], cfg, check=False)
    cand = masks.cand
    # torch.where, not masked_fill: the same values, twice as fast on the CPU.
    lg = torch.where(cand, logits[..., :length], float("-inf"))
    if masks.full:
        # torch.logsumexp's own steps, minus its guard for infinite maxima (none here).
        top = lg.amax(dim=-1, keepdim=True)
        lse = (lg - top).exp_().sum(dim=-1, keepdim=True).log_().add_(top)
    else:
        lse = torch.logsumexp(lg, dim=-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, 0.0)
    mass = torch.exp(lg - lse).sum(dim=1)  # [T, S]; 0 where not a candidate
    score = torch.where(cand[:, 0], mass, masks.base)
    kk = min(cfg.top_k, length)
    vals, idx = score.topk(kk, dim=-1)
    if masks.full:  # every kept score is >= 0: nothing to push past the end
        idx = idx.sort(dim=-1).values
    else:
        idx = torch.where(vals >= 0, idx, length)  # non-causal -> sorts last
        idx = idx.sort(dim=-1).values
        idx = torch.where(idx < length, idx, -1)
    if kk == width:  # the common case (decode): no padding columns to add
        return idx.to(torch.int32)
    out = torch.full((t, width), -1, dtype=torch.int32, device=logits.device)
    n = min(kk, width)
    out[:, :n] = idx[:, :n].to(torch.int32)
    return out


def dense_topk(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Every position ``<= t`` for each query, ascending, ``int32 [T, width]`` (-1 padded)."""
    s = torch.arange(width, device=positions.device)[None, :]
    out = s.expand(positions.shape[0], -1).to(torch.int32)
    return torch.where(s <= positions[:, None], out, torch.full_like(out, -1))


def dense_rows(positions: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """`dense_topk` of decode rows: a row with no keys (``lengths == 0``: a padding row of a
    fixed-shape step) selects nothing, as the Triton select leaves it."""
    return dense_topk(torch.where(lengths > 0, positions, -1), width)


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
