"""Random paged indexer cases for the lightning indexer's tests and benchmarks, the
reference scores they are checked against, and what "the same selection" means when scores
tie within rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.config import cdiv
from hisparse.kv.row_formats import IndexerCacheFormat

Tensor = torch.Tensor


@dataclass
class PagedIndexerCase:
    """One packed batch of query tokens and the paged indexer cache they score."""

    q: Tensor
    q_scale: Tensor | None
    weights: Tensor
    pages: Tensor
    fmt: IndexerCacheFormat
    block_table: Tensor
    req_index: Tensor
    positions: Tensor
    seq_lens: Tensor
    softmax_scale: float

    def args(self) -> tuple:
        """Positional arguments up to ``block_table``, ``req_index``, ``positions``."""
        return (self.q, self.q_scale, self.weights, self.pages, self.fmt, self.block_table,
                self.req_index, self.positions)  # fmt: skip

    @property
    def limits(self) -> Tensor:
        """Keys each token may pick (``positions + 1``; 0 for padding tokens)."""
        return torch.where(self.req_index >= 0, self.positions + 1, 0)


def random_indexer_case(
    kind: str,
    contexts: list[int],
    queries: list[int],
    *,
    heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device | str,
    seed: int,
    extra_blocks: int = 1,
    pad_tokens: int = 0,
) -> PagedIndexerCase:
    """Fresh random keys, queries and a shuffled block table.

    Request ``r`` holds ``contexts[r]`` keys and asks ``queries[r]`` tokens, at positions
    ``contexts[r] - queries[r] .. contexts[r] - 1`` (1: decode; more: a prefill chunk). Keys
    and queries are Gaussian, quantized the way the fp8 indexer mode does (per-token e4m3 with
    power-of-two scales) or kept fp32. The table is ``extra_blocks`` wider than needed (its
    columns point at block 0) and ``pad_tokens`` padding tokens (``req_index -1``) follow.
    """
    from hisparse.attention.indexer_reference import quantize_indexer_fp8

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    fmt = IndexerCacheFormat.for_mode("fp8" if kind == "fp8" else "exact", head_dim)
    per_req = [cdiv(c, block_size) for c in contexts]
    width = max(per_req) + extra_blocks
    num_blocks = 1 + sum(per_req)
    perm = 1 + torch.randperm(num_blocks - 1, generator=g, device=dev).to(torch.int32)
    table = torch.zeros(len(contexts), width, dtype=torch.int32, device=dev)
    at = 0
    for r, nb in enumerate(per_req):
        table[r, :nb] = perm[at : at + nb]
        at += nb
    pages = torch.empty(num_blocks, fmt.page_bytes(block_size), dtype=torch.uint8, device=dev)
    step = max(1, 2**20 // block_size)  # blocks per chunk: 1M keys
    for b0 in range(0, num_blocks, step):
        b1 = min(num_blocks, b0 + step)
        k = torch.randn((b1 - b0) * block_size, head_dim, generator=g, device=dev)
        if kind == "fp8":
            k8, ks = quantize_indexer_fp8(k, fmt.tile)
            nkey = block_size * head_dim
            pages[b0:b1, :nkey] = k8.view(torch.uint8).view(b1 - b0, nkey)
            pages[b0:b1, nkey:] = ks.view(torch.uint8).view(b1 - b0, -1)
        else:
            pages[b0:b1] = k.view(torch.uint8).view(b1 - b0, -1)
    req = [r for r, n in enumerate(queries) for _ in range(n)] + [-1] * pad_tokens
    pos = [c - n + i for c, n in zip(contexts, queries, strict=True) for i in range(n)]
    pos += [0] * pad_tokens
    t = len(req)
    q = torch.randn(t, heads, head_dim, generator=g, device=dev)
    q_scale = None
    if kind == "fp8":
        q, q_scale = quantize_indexer_fp8(q, fmt.tile)
    weights = torch.randn(t, heads, generator=g, device=dev) * heads**-0.5
    return PagedIndexerCase(
        q=q, q_scale=q_scale, weights=weights, pages=pages, fmt=fmt, block_table=table,
        req_index=torch.tensor(req, dtype=torch.int64, device=dev),
        positions=torch.tensor(pos, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(contexts, dtype=torch.int64, device=dev),
        softmax_scale=head_dim**-0.5,
    )  # fmt: skip


def reference_scores(case: PagedIndexerCase, num_cols: int) -> Tensor:
    """``fp32 [T, num_cols]`` reference scores, ``-inf`` past each token's limit."""
    from hisparse.attention.indexer_reference import indexer_scores_exact, indexer_scores_fp8
    from hisparse.kv.row_formats import read_indexer_keys

    t = case.q.shape[0]
    bs = case.pages.shape[1] // case.fmt.row_bytes
    out = torch.full((t, num_cols), float("-inf"), device=case.q.device)
    for r in range(case.seq_lens.shape[0]):
        tok = torch.nonzero(case.req_index == r).flatten()
        if tok.numel() == 0:
            continue
        length = int(case.seq_lens[r])
        pos = torch.arange(length, device=case.q.device)
        rows = case.block_table[r, pos // bs].long() * bs + pos % bs
        keys, k_scales = read_indexer_keys(case.pages, case.fmt, rows)
        if case.fmt.kind == "fp8":
            assert case.q_scale is not None and k_scales is not None
            s = indexer_scores_fp8(case.q[tok], case.q_scale[tok], case.weights[tok], keys,
                                   k_scales, case.softmax_scale)  # fmt: skip
        else:
            s = indexer_scores_exact(case.q[tok], case.weights[tok], keys, case.softmax_scale)
        out[tok, :length] = s
    cols = torch.arange(num_cols, device=out.device)
    return out.masked_fill(cols[None, :] >= case.limits[:, None], float("-inf"))


def score_tolerance(ref: Tensor, rtol: float, atol: float) -> Tensor:
    """Per token: ``atol + rtol * max |finite reference score|`` (``[T, 1]``)."""
    finite = torch.where(torch.isfinite(ref), ref.abs(), torch.zeros_like(ref))
    return atol + rtol * finite.amax(dim=1, keepdim=True)


def selection_errors(
    out: Tensor, ref: Tensor, limits: Tensor, top_k: int, tol: Tensor
) -> list[str]:
    """Why ``out [T, top_k]`` is not a top-k of reference scores ``ref [T, S]`` (empty: it is).

    Equal to the reference means, per token with ``n = min(top_k, limit)`` and ``v_n`` the
    reference's n-th best score: the first ``n`` entries are distinct positions below the
    limit and the rest ``-1``; every pick scores at least ``v_n - tol``; and where
    ``v_n - v_{n+1} > tol`` the picks are exactly the reference's ``n`` best. Closer scores may
    swap through summation order. The order of the picks is free (``torch.topk`` writes them
    best first, the Triton select in ascending positions).
    """
    errors: list[str] = []
    t = out.shape[0]
    if t == 0:
        return errors
    n_sel = limits.clamp(max=top_k)
    col = torch.arange(top_k, device=out.device)
    should = col[None, :] < n_sel[:, None]
    out = out.long()
    if not torch.equal(out >= 0, should):
        errors.append("-1 padding does not match min(top_k, positions + 1)")
        return errors
    if ((out >= limits[:, None]) & should).any():
        errors.append("a pick lies past the token's causal limit")
    srt = out.sort(dim=1).values
    if ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any():
        errors.append("a position is picked twice")
    if errors:
        return errors
    kk = min(top_k + 1, ref.shape[1])
    best = ref.topk(kk, dim=1).values
    v_n = best.gather(1, (n_sel - 1).clamp(min=0)[:, None])
    picked = ref.gather(1, out.clamp(min=0))
    if ((picked < v_n - tol) & should).any():
        errors.append("a pick scores below the n-th best reference score by more than tol")
    if kk > top_k:
        nxt = best[:, top_k : top_k + 1]
        separated = (n_sel == top_k)[:, None] & (v_n - nxt > tol)
        n_top = ((picked >= v_n) & should).sum(dim=1, keepdim=True)
        if (separated & (n_top != n_sel[:, None])).any():
            errors.append("a separated top-k set differs from the reference's")
    return errors
