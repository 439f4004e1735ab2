"""Triton DeepSeek-V4 attention over physical rows; `v4_attention_paged_reference` is the oracle.

Each query token attends with all its heads over its own rows of a layer's pool (the window's
rows, then its entries; ``-1`` masked): one shared K = V head, so a program loads each row once
for a block of ``BLOCK_H`` heads (``[BLOCK_H, D] x [D, BLOCK_N]`` scores, ``[BLOCK_H, BLOCK_N]
x [BLOCK_N, D]`` values, D = 512 in the releases). An online softmax (fp32, base 2) runs over
the rows, split over them (flash-decoding, as `sparse_gqa_triton`: program ``(head block,
token, split)``; the shared combine kernel merges the splits' outputs by their log-sum-exp);
the per-head sink joins last as one more logit with a zero value row: the rows keep
``sigmoid(lse − sink)`` of the weight.

Numerics as `sparse_gqa_triton`: fp32 accumulation; 16-bit operands where queries and rows are
both bf16 / fp16, fp32 with IEEE precision otherwise and under Triton's CPU interpreter.
No host synchronisation and no data-dependent shapes (the split count depends on shapes only:
CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.attention.sparse_mla_triton import LOG2E, interpreting
from hisparse.attention.triton_split import combine_splits, grid_slices, num_sms, split_length

Tensor = torch.Tensor

BLOCK_H = 16
BLOCK_N = 32
LN2_C = tl.constexpr(0.6931471805599453)


def supports(q: Tensor, pool: Tensor, entry_col: int) -> bool:
    """Whether the kernel takes these inputs (else callers use the reference)."""
    d = q.shape[-1] if q.dim() == 3 else 0
    return (
        d >= 16
        and d & (d - 1) == 0
        and pool.dim() == 3
        and pool.stride(2) == 1
        and pool.dtype == q.dtype
        and pool.shape[2] >= max(d, entry_col + d)
    )


@triton.jit
def _v4_attention_kernel(
    q_ptr,
    pool_ptr,  # [blocks, block_size, values] in the rows' dtype
    idx_ptr,
    out_ptr,  # fp32 [tokens, heads, splits, D]: each split's output, normalised over it
    lse_ptr,  # fp32 [tokens, heads, splits]
    sm_scale_log2,
    n_heads,
    n_rows,
    n_window,
    entry_col,
    block_size,
    split_len,
    s_q_t,
    s_q_h,
    s_p_b,
    s_p_r,
    s_i_t,
    s_o_t,
    s_o_h,
    s_o_s,
    s_l_t,
    s_l_h,
    s_l_s,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * s_q_t + heads.to(tl.int64)[:, None] * s_q_h + d[None, :],
                mask=hmask[:, None], other=0.0).to(DOT)  # fmt: skip

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, n_rows)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * s_i_t + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0).to(tl.int64)
        col = tl.where(offs < n_window, 0, entry_col).to(tl.int64)
        rows = (safe // block_size) * s_p_b + (safe % block_size) * s_p_r + col
        kv = tl.load(pool_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        kv = kv.to(DOT)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = tl.dot(p.to(DOT), kv, acc * alpha[:, None], input_precision=PRECISION)

    # Normalise over this split; a head that saw no valid row gets out 0 and lse -inf.
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(lse_ptr + t * s_l_t + sp * s_l_s + heads * s_l_h, lse, mask=hmask)
    o = out_ptr + t * s_o_t + sp * s_o_s + heads.to(tl.int64)[:, None] * s_o_h + d[None, :]
    tl.store(o, acc * inv[:, None], mask=hmask[:, None])


def num_splits_for(tokens: int, heads: int, rows: int, device: torch.device) -> int:
    """Splits over the rows (flash-decoding): enough programs for ~2 waves, each split at
    least 2 tiles long."""
    programs = max(1, tokens * triton.cdiv(heads, BLOCK_H))
    want = triton.cdiv(2 * num_sms(device), programs)
    return max(1, min(want, triton.cdiv(max(rows, 1), 2 * BLOCK_N)))


def v4_attention_triton(
    q: Tensor,
    pool: Tensor,
    indices: Tensor,
    n_window: int,
    entry_col: int,
    sinks: Tensor,
    scale: float,
    *,
    out: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """Same contract as `v4_attention_paged_reference`: ``out [N, H, D]`` in q's dtype
    (written into ``out`` where given).

    ``pool [blocks, block_size, values]`` in q's dtype, unit stride on the values; ``indices
    [N, K]`` int physical rows (``-1`` masked), the first ``n_window`` read at value 0, the
    rest at ``entry_col``; ``sinks [H]``.
    """
    n, h, d = q.shape
    if indices.dim() != 2 or indices.shape[0] != n:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, indices {tuple(indices.shape)}")
    if not supports(q, pool, entry_col):
        raise ValueError(
            f"Triton V4 attention needs q [N, H, D] with D a power of two >= 16 and a pool "
            f"[blocks, block_size, >= {entry_col + d}] in q's dtype with unit value stride; "
            f"got q {tuple(q.shape)} {q.dtype}, pool {tuple(pool.shape)} {pool.dtype} "
            f"strides {pool.stride()}"
        )
    out = torch.empty_like(q) if out is None else out
    if n == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    rows = indices.shape[1]
    splits = num_splits or num_splits_for(n, h, rows, q.device)
    split_len = split_length(rows, splits, BLOCK_N)
    parts = torch.empty(n, h, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(n, h, splits, dtype=torch.float32, device=q.device)
    interp = interpreting() or q.device.type != "cuda"
    if interp or q.dtype == torch.float32:
        dot, precision = tl.float32, "ieee"
    else:
        dot, precision = (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "ieee"
    for lo, hi in grid_slices(n):
        _v4_attention_kernel[(triton.cdiv(h, BLOCK_H), hi - lo, splits)](
            q[lo:hi], pool, indices[lo:hi], parts[lo:hi], part_lse[lo:hi],
            scale * LOG2E, h, rows, n_window, entry_col, pool.shape[1], split_len,
            q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), indices.stride(0),
            parts.stride(0), parts.stride(1), parts.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, DOT=dot, PRECISION=precision,
        )  # fmt: skip
    if splits > 1:
        merged = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
        combine_splits(parts, part_lse, merged, lse)
    else:
        merged, lse = parts[:, :, 0], part_lse[:, :, 0]
    # The sink: one more logit per head weighing a zero row, so the rows keep the share
    # exp(lse) / (exp(lse) + exp(sink)) (0 where no row was valid).
    out.copy_(merged * torch.sigmoid(lse - sinks.float()[None, :]).unsqueeze(-1))
    return out


__all__ = ["num_splits_for", "supports", "v4_attention_triton"]
