"""The GQA indexer's scores and selection: each method's approximate logits from the compact
keys, and the rule all methods share (per query head a softmax over the candidates, the
attention mass summed over heads, sink and recent positions always kept; see
`gqa_indexer_reference`). Split from the top-k drivers so that the rule reads on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat


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
