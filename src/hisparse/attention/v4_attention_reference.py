"""DeepSeek-V4's attention over gathered rows: one softmax over the window and the entries.

Every V4 layer attends one shared key/value head (``K = V``, 512 values in the releases) from all
query heads. A query's candidate rows are its sliding window's rows followed by the compressed
entries it may read (all earlier entries of a heavily compressed layer, the indexer's top-k of a
compressed sparse layer); a learnable per-head sink joins the softmax as one more logit whose
value row is zero. This reference defines what a kernel must compute (summation order aside).
"""

from __future__ import annotations

import torch


def v4_attention_reference(
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[N, H, D]`` attention of queries ``q [N, H, D]`` over their rows ``rows [N, K, D]``
    (keys and values alike), rows with ``valid [N, K]`` False masked, and a sink logit
    ``sinks [H]`` per head in the softmax. Computed in fp32, returned in ``q``'s dtype."""
    logits = torch.einsum("nhd,nkd->nhk", q.float(), rows.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("nhk,nkd->nhd", probs, rows.float()).to(q.dtype)


def v4_paged_rows(
    pool: torch.Tensor, indices: torch.Tensor, n_window: int, entry_col: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, K, D], valid [N, K])`` that ``indices [N, K]`` name in a row pool ``pool
    [blocks, block_size, values]`` (physical row ``block * block_size + offset``, ``-1``
    masked): the first ``n_window`` columns of ``indices`` read values ``[0, D)`` of their row
    (window rows), the rest ``[entry_col, entry_col + D)`` (entries)."""
    bs = pool.shape[1]
    valid = indices >= 0
    safe = indices.clamp(min=0).long()
    rows = pool[safe // bs, safe % bs]  # [N, K, values]
    window = rows[:, :n_window, :head_dim]
    entries = rows[:, n_window:, entry_col : entry_col + head_dim]
    rows = torch.cat((window, entries), dim=1)
    return rows.masked_fill(~valid.unsqueeze(-1), 0), valid


def v4_attention_paged_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    indices: torch.Tensor,
    n_window: int,
    entry_col: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`v4_attention_reference` over the rows ``indices`` name in ``pool`` (`v4_paged_rows`):
    the contract of the Triton kernel (`v4_attention_triton`)."""
    rows, valid = v4_paged_rows(pool, indices, n_window, entry_col, q.shape[-1])
    return v4_attention_reference(q, rows, valid, sinks, scale)
