"""Reference lightning indexer: scores of each query token against cached keys, and top-k.

Score of query token ``t`` against key ``s`` (docs/design.md §9.2):
``I[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s] · d^-0.5)`` with ``w = weights_proj(x) · H^-0.5``.
Two modes:

- ``exact``: fp32 q and k, the formula as written; matches transformers' reference.
- ``fp8``: DeepSeek's inference path. q and k go through a Hadamard rotation (orthogonal, so
  exact scores are unchanged; it spreads outliers before quantizing), then e4m3 in tiles of
  128 with power-of-two (``ue8m0``) scales; the dot product runs on the e4m3 values and the
  scales multiply the result.

The top-k keeps only keys at positions ``≤ t`` and pads with ``-1``: a token with fewer than
``k`` earlier keys selects all of them.

`indexer_topk_paged_reference` runs both steps for a packed batch over the paged indexer
cache (the model's indexer calls it through `dispatch.indexer_topk_paged`, which picks the Triton
kernel of `hisparse.attention.indexer_triton` on CUDA).
"""

from __future__ import annotations

import torch

from hisparse.kv.row_formats import IndexerCacheFormat, quantize_fp8_tiles, read_indexer_keys

#: DeepSeek's act_quant floors a tile's absolute maximum at this value.
FP8_INDEXER_MIN_AMAX = 1e-4
#: Most bytes of fp32 scores that one block of query tokens holds at once in a top-k call
#: (the Triton path's ``[rows, S]`` score buffer, the reference's ``[rows, H, S]`` per-head
#: logits): a prefill chunk at a long context is scored block by block (`score_row_blocks`)
#: instead of materialising ``[T, S]`` (64K tokens x 128K keys: 32 GiB). Tests lower it.
SCORE_BLOCK_BYTES = 1 << 30


def score_row_blocks(num_rows: int, bytes_per_row: int) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges of about equal size covering rows ``0 .. num_rows - 1`` in
    order, each at most `SCORE_BLOCK_BYTES` of ``bytes_per_row`` (but at least one row)."""
    if num_rows <= 0:
        return []
    most = max(1, SCORE_BLOCK_BYTES // max(1, bytes_per_row))
    size = -(-num_rows // -(-num_rows // most))
    return [(lo, min(num_rows, lo + size)) for lo in range(0, num_rows, size)]


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard transform of the last dim, scaled by ``n^-0.5``.

    Same ordering and scale as ``fast_hadamard_transform(x, scale=n**-0.5)``, which DeepSeek's
    ``rotate_activation`` calls; ``n`` must be a power of two.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two dim; got {n}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, n) * n**-0.5).to(x.dtype)


def quantize_indexer_fp8(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and power-of-two fp32 scales per ``tile`` (DeepSeek ``act_quant``, ue8m0)."""
    return quantize_fp8_tiles(
        x, min(tile, x.shape[-1]), pow2_scale=True, min_amax=FP8_INDEXER_MIN_AMAX
    )


def indexer_scores_exact(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """``[T, S]`` fp32 scores of queries ``q [T, H, D]`` against ``keys [S, D]``.

    ``weights [T, H]`` already include ``H^-0.5``. Same operation order as transformers:
    ``ReLU((q·k) · scale)`` per head, then the weighted sum over heads as one matmul.
    """
    per_head = torch.relu(torch.matmul(q.float(), keys.float().t()) * softmax_scale)  # [T,H,S]
    return torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)


def indexer_scores_fp8(
    q_fp8: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """``[T, S]`` fp32 scores from e4m3 queries ``[T, H, D]`` and keys ``[S, D]``.

    ``q_scale [T, H, n]`` and ``k_scale [S, n]`` hold one scale per tile. With one tile per key
    (DeepSeek: D = 128) this is DeepSeek's ``fp8_index``: ``k_scale[s] · Σ_h (w · q_scale ·
    softmax_scale)[t, h] · ReLU(q_fp8 · k_fp8)``; with several tiles the per-tile products are
    summed before the ReLU.
    """
    n_tiles = k_scale.shape[-1]
    if n_tiles == 1:
        logits = torch.relu(torch.matmul(q_fp8.float(), k_fp8.float().t()))  # [T,H,S]
        w = weights.float() * q_scale[..., 0].float() * softmax_scale  # [T,H]
        return torch.matmul(w.unsqueeze(-2), logits).squeeze(-2) * k_scale[:, 0].float()
    tile = q_fp8.shape[-1] // n_tiles
    q = q_fp8.float().unflatten(-1, (n_tiles, tile)) * q_scale.float().unsqueeze(-1)
    k = k_fp8.float().unflatten(-1, (n_tiles, tile)) * k_scale.float().unsqueeze(-1)
    dots = torch.relu(torch.matmul(q.flatten(-2), k.flatten(-2).t()) * softmax_scale)
    return torch.matmul(weights.float().unsqueeze(-2), dots).squeeze(-2)


def indexer_topk(scores: torch.Tensor, num_valid: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` key positions per row of ``scores [T, S]``, ``int32 [T, k]``, ``-1`` padded.

    Row ``t`` may pick keys ``0 .. num_valid[t] - 1`` only (causality: ``num_valid = pos + 1``).
    Rows with at most ``k`` valid keys select every valid key.
    """
    t, s = scores.shape
    pos = torch.arange(s, device=scores.device)
    masked = scores.float().masked_fill(pos[None, :] >= num_valid[:, None], float("-inf"))
    kk = min(k, s)
    out = torch.full((t, k), -1, dtype=torch.int32, device=scores.device)
    if kk == 0:
        return out
    vals, idx = masked.topk(kk, dim=-1)
    out[:, :kk] = torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx).to(torch.int32)
    return out


def indexer_topk_paged_reference(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    weights: torch.Tensor,
    pages: torch.Tensor,
    fmt: IndexerCacheFormat,
    block_table: torch.Tensor,
    req_index: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Top-k of every token of a packed batch over its request's paged indexer keys.

    ``q [N, H, D]`` (fp32/bf16 for ``fp32`` pages, e4m3 with ``q_scale [N, H, tiles]`` for
    ``fp8`` pages), ``weights [N, H]`` (with ``H^-0.5``), ``pages [NB, BS * row_bytes]``,
    ``block_table [R, max_blocks]``, ``req_index [N]`` (``< 0``: padding, all ``-1``),
    ``positions [N]`` (token ``t`` may pick keys ``0 .. positions[t]``), ``seq_lens [R]`` keys
    each request holds. Returns ``int32 [N, top_k]``, ``-1`` padded, best first.

    A request's tokens are scored in blocks of at most `SCORE_BLOCK_BYTES` of per-head
    logits (each token's scores and top-k depend on that token alone).
    """
    n = q.shape[0]
    bs = pages.shape[1] // fmt.row_bytes
    out = torch.full((n, top_k), -1, dtype=torch.int32, device=q.device)
    for r in range(seq_lens.shape[0]):
        tok_r = torch.nonzero(req_index == r).flatten()
        if tok_r.numel() == 0:
            continue
        length = int(seq_lens[r])
        pos = torch.arange(length, device=q.device)
        rows = block_table[r, pos // bs].long() * bs + pos % bs
        keys, k_scales = read_indexer_keys(pages, fmt, rows)
        if fmt.kind == "fp8" and (q_scale is None or k_scales is None):
            raise ValueError("fp8 indexer scoring needs q_scale and fp8 key pages")
        for lo, hi in score_row_blocks(tok_r.numel(), 4 * q.shape[1] * length):
            tok = tok_r[lo:hi]
            if fmt.kind == "fp8":
                assert q_scale is not None and k_scales is not None
                scores = indexer_scores_fp8(
                    q[tok], q_scale[tok], weights[tok], keys, k_scales, softmax_scale
                )
            else:
                scores = indexer_scores_exact(q[tok], weights[tok], keys, softmax_scale)
            out[tok] = indexer_topk(scores, positions[tok] + 1, top_k)
            del scores  # before the next block's
    return out
