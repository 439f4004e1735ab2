"""The GQA indexer's CPU selections in compiled calls (`CpuBackend.jit`): one decode query's
fp8 scoring and selection, and a prefill's scored selection (chunked matmuls, then one
compiled pass per query). The same selection rule as the reference; the sums round in another
order (tests/test_cpu_jit.py checks both against it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat

#: `scored_topk_cpu`'s bound on one chunk's logits (fp32 elements).
_CPU_SCORE_ELEMENTS = 1 << 20


def fp8_topk_one_cpu(
    q: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    length: int,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
) -> torch.Tensor | None:
    """One CPU query's fp8 selection in one compiled call (`fp8_topk_row` kernel: the same
    rule as `select_topk`, a dozen torch ops and a 100k-element key decode fewer per layer
    and step). ``None`` where numba is missing or the compiled path does not apply."""
    from hisparse.runtime.ops import cpu_backend

    fns = cpu_backend().jit()
    assert cfg.top_k is not None
    kk = min(cfg.top_k, length)
    if fns is None or width < kk:
        return None
    g, d = fmt.num_kv_heads, fmt.head_dim
    h = q.shape[1]
    paged = cpu_backend().views.paged_pages(pages, g * d)
    if h % g or q.shape[2] != d or paged is None:
        return None
    qf = q if q.dtype == torch.float32 else q.float()
    out = np.full((1, width), -1, dtype=np.int32)
    lut = cpu_backend().fp8_lut()
    ok = fns.fp8_topk_row(
        qf.detach().reshape(g, h // g, d).numpy(), *paged, table.numpy(), lut, length,
        int(positions.numpy()[0]), cfg.sink_tokens, cfg.recent_window, cfg.top_k,
        float(scale), out[0],
    )  # fmt: skip
    return torch.from_numpy(out) if ok else None


def cpu_compiled(q: torch.Tensor, fmt: GqaIndexerFormat) -> bool:
    """Whether `_topk_prefill_cpu` serves a prefill step (numba, fp8 or lowrank keys)."""
    from hisparse.runtime.ops import cpu_backend

    return q.device.type == "cpu" and fmt.method != "quest" and cpu_backend().jit() is not None


def scored_topk_cpu(
    q: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None,
) -> torch.Tensor | None:
    """`select_topk` of `approx_logits` for one request's scored CPU queries (fp8, lowrank;
    numba): the queries in position order, in chunks; per chunk one batched matmul against
    only the candidate keys its last query sees (the causal half of the ``[T, S]`` logits),
    then one compiled pass per query for the softmax mass and the top-k
    (`topk_rows` kernel, the queries split over torch's thread count) instead of a dozen
    passes of torch ops over every chunk. The same rule; a query's selection depends on its
    own logits only, so a chunked prefill chooses what a whole one does (BLAS rounds a
    logit alike in any chunk of two or more queries here; tests/test_cpu_jit.py checks the
    selections).
    ``keys``: `read_index_keys`. ``None`` where it does not apply (a query before position
    ``top_k``, too few columns)."""
    from hisparse.runtime.ops import cpu_backend

    fns = cpu_backend().jit()
    top_k = cfg.top_k
    length = keys.shape[0]
    if fns is None or top_k is None or fmt.method == "quest" or q.device.type != "cpu":
        return None
    kk = min(top_k, length)
    t, h, _ = q.shape
    g = fmt.num_kv_heads
    pos = positions.long()
    if width < kk or t == 0 or h % g or int(pos.min()) < top_k or int(pos.max()) >= length:
        return None
    sink, window = cfg.sink_tokens, cfg.recent_window
    # scale = D^-0.5 is a power of two for the usual head dims: exact on q or on the logits.
    qg = q.float().view(t, g, h // g, -1) * scale
    if fmt.method == "lowrank":
        assert dims is not None
        idx = dims.to(q.device)[None, :, None, :].expand(t, g, h // g, -1)
        qg = torch.gather(qg, 3, idx)
    in_order = bool((pos[1:] >= pos[:-1]).all())  # a prefill chunk: already ascending
    order = None if in_order else torch.argsort(pos, stable=True)
    if order is not None:
        qg, pos = qg[order], pos[order]
    qh, kd = h // g, qg.shape[-1]
    q_t = qg.transpose(0, 1).reshape(g, t * qh, kd)  # [G, queries · heads, key_dim]
    his = (pos - window).clamp(max=length - 1).tolist()
    key_t = keys[sink:].permute(1, 2, 0)  # [G, key_dim, candidates]
    out = torch.empty(t, width, dtype=torch.int32)
    parts = cpu_backend().parts()
    lo = 0
    while lo < t:
        hi = lo + 1  # the chunk grows while its logits fit the bound
        while hi < t and (hi + 1 - lo) * h * (his[hi] - sink + 1) <= _CPU_SCORE_ELEMENTS:
            hi += 1
        n_cand = his[hi - 1] - sink + 1
        qc, pc, rows = q_t[:, lo * qh : hi * qh], pos[lo:hi], out[lo:hi]
        if hi - lo == 1:
            # A lone query goes twice: a matmul of one query's heads rounds differently
            # (BLAS takes another kernel), and a chunked prefill must score as a whole one.
            qc, pc, rows = qc.repeat(1, 2, 1), pc.repeat(2), torch.empty(2, width, dtype=out.dtype)
        m = pc.shape[0]
        logits = torch.matmul(qc, key_t[:, :, :n_cand]).view(g, m, qh, n_cand)
        done = fns.topk_rows(
            logits.numpy(), pc.numpy(), length, sink, window, top_k, rows.numpy(), parts
        )
        if not done:
            return None
        if hi - lo == 1:
            out[lo] = rows[0]
        lo = hi
    if order is not None:
        out[order] = out.clone()
    return out
