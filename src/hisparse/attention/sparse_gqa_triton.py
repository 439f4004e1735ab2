"""Triton sparse GQA decode over physical row indices; `sparse_gqa_reference` is the oracle.

Each query token attends over its own ``top_k`` physical rows of the paged K+V row pool
(`GqaRowFormat`: ``[K_0 … K_{G-1} ‖ V_0 … V_{G-1}]`` per token, ``-1`` entries masked). The
``H / G`` query heads that share KV head ``g`` are handled by one program, so each K and V
slice is read once per (token, KV head) and reused by all of them: ``[BLOCK_Q, D] x [D,
BLOCK_N]`` for the scores, ``[BLOCK_Q, BLOCK_N] x [BLOCK_N, D]`` for the values (``BLOCK_Q``
pads the group to the 16 rows a tensor-core dot needs; SmolLM2 has 3 heads per group).

Work is split over the top-k (flash-decoding), as in `sparse_mla_triton`: program ``(KV head,
token, split)`` runs an online softmax (fp32, base 2) over its slice of the indices; with more
than one split it writes an fp32 partial (normalised output and log-sum-exp) and the shared
combine kernel merges them. Small batches get many splits, so batch 1 still fills the GPU.
More than 65535 tokens (CUDA's grid axis 1 limit) go out as several launches over slices of
the tokens (`triton_split.grid_slices`).

Numerics: dots accumulate in fp32. Their operands are the rows' dtype when queries and rows
are both 16-bit (bf16 / fp16: the rows are exact, ``q`` is already in that dtype, the
probabilities ``p`` are rounded to it, as in FlashAttention), fp32 with IEEE precision
otherwise (fp32 models and rows: no tf32 rounding, so fp32 runs stay close to the reference).
Under Triton's CPU interpreter every dot runs in fp32 (its bf16 dot is wrong).

No host synchronisation and no data-dependent shapes: the split count depends on shapes
only, so a decode step calling this can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hisparse.attention.sparse_gqa_reference import GqaRowFormat
from hisparse.attention.sparse_mla_triton import LOG2E, interpreting
from hisparse.attention.triton_split import (
    combine_splits,
    grid_slices,
    num_sms,
    split_buffers,
    split_length,
)

Tensor = torch.Tensor

LN2 = tl.constexpr(0.6931471805599453)
#: Rows of a tensor-core dot: the query group is padded up to this.
_MIN_BLOCK_Q = 16


@dataclass(frozen=True)
class GqaDecodeConfig:
    """Tile shape of the decode kernel (`default_config` picks one)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_config(num_tokens: int, top_k: int) -> GqaDecodeConfig:
    """Tile shape used when the caller gives none."""
    del num_tokens, top_k
    return GqaDecodeConfig()


def supports(q: Tensor, kv_cache: Tensor, row_format: GqaRowFormat) -> bool:
    """Whether the kernel handles these inputs (else callers use the reference)."""
    d = row_format.head_dim
    return (
        q.dim() == 3
        and q.shape[-1] == d
        and q.shape[1] % row_format.num_kv_heads == 0
        and d >= 16
        and d & (d - 1) == 0
        and kv_cache.dim() == 3
        and kv_cache.dtype == torch.uint8
        and kv_cache.stride(2) == 1
        and kv_cache.shape[2] == row_format.row_bytes
        and all(s % row_format.torch_dtype.itemsize == 0 for s in kv_cache.stride()[:2])
        and kv_cache.storage_offset() % row_format.torch_dtype.itemsize == 0
    )


@triton.jit
def _sparse_gqa_decode_kernel(
    q_ptr,
    kv_ptr,  # the row pool viewed in the rows' dtype: [blocks, block_size, 2 * G * D]
    idx_ptr,
    out_ptr,
    lse_ptr,
    sm_scale_log2,
    group,  # query heads per KV head
    top_k,
    block_size,
    split_len,
    s_q_t,
    s_q_h,
    s_kv_b,
    s_kv_r,
    s_idx_t,
    s_o_t,
    s_o_h,
    s_o_s,
    s_l_t,
    s_l_h,
    s_l_s,
    KV_WIDTH: tl.constexpr,  # G * D: where V starts in a row
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    g = tl.program_id(0)  # fastest: the KV heads of one (token, split) read the same rows
    t = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)

    qi = tl.arange(0, BLOCK_Q)
    qmask = qi < group
    heads = g * group + qi
    d = tl.arange(0, D)
    qp = q_ptr + t * s_q_t + heads.to(tl.int64)[:, None] * s_q_h + d[None, :]  # any q strides
    q = tl.load(qp, mask=qmask[:, None], other=0.0).to(DOT)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, D], tl.float32)

    k_col = g * D + d
    v_col = KV_WIDTH + g * D + d
    start = sp * split_len
    end = tl.minimum(start + split_len, top_k)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * s_idx_t + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0).to(tl.int64)
        rows = (safe // block_size) * s_kv_b + (safe % block_size) * s_kv_r
        k = tl.load(kv_ptr + rows[:, None] + k_col[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(kv_ptr + rows[:, None] + v_col[None, :], mask=valid[:, None], other=0.0)

        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = tl.dot(p.to(DOT), v.to(DOT), acc * alpha[:, None], input_precision=PRECISION)

    # Normalise; a head that saw no valid row gets out 0 and lse -inf.
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + t * s_l_t + sp * s_l_s + heads * s_l_h, lse, mask=qmask)
    o = out_ptr + t * s_o_t + sp * s_o_s + heads[:, None] * s_o_h + d[None, :]
    tl.store(o, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])


def num_splits_for(
    num_tokens: int, num_kv_heads: int, top_k: int, cfg: GqaDecodeConfig, device: torch.device
) -> int:
    """Splits over top-k: enough programs for ~2 waves, each split at least 2 tiles long."""
    programs = max(1, num_tokens * num_kv_heads)
    want = triton.cdiv(2 * num_sms(device), programs)
    most = max(1, triton.cdiv(top_k, 2 * cfg.block_n))
    return max(1, min(want, most))


def _dot_dtype(q: Tensor, row_format: GqaRowFormat, interp: bool) -> tuple[tl.dtype, str]:
    rows = row_format.torch_dtype
    if interp or rows == torch.float32 or q.dtype != rows:
        return tl.float32, "ieee"
    return (tl.bfloat16 if rows == torch.bfloat16 else tl.float16), "ieee"


def sparse_gqa_decode_triton(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    scale: float,
    row_format: GqaRowFormat,
    *,
    config: GqaDecodeConfig | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Same contract as `sparse_gqa_reference` (``out [T, H, D]`` in q's dtype, ``lse [T, H]``).

    ``kv_cache`` is ``[num_blocks, block_size, row_bytes]`` uint8 with any strides on the first
    two dims and unit stride on the bytes; ``indices [T, K]`` int physical rows, ``-1``
    masked. ``config`` / ``num_splits`` override the tile shape and the split count.
    """
    t, h, d = q.shape
    g = row_format.num_kv_heads
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, indices {tuple(indices.shape)}")
    if not supports(q, kv_cache, row_format):
        raise ValueError(
            f"Triton sparse GQA needs uint8 rows of {row_format.row_bytes} B ({g} KV heads x "
            f"{row_format.head_dim}, a power of two >= 16) with unit byte stride and q [T, H, "
            f"{row_format.head_dim}] with H a multiple of {g}; got kv {tuple(kv_cache.shape)} "
            f"strides {kv_cache.stride()}, q {tuple(q.shape)}"
        )
    device = q.device
    k = indices.shape[1]
    group = h // g
    cfg = config or default_config(t, k)
    splits = num_splits or num_splits_for(t, g, k, cfg, device)
    split_len = split_length(k, splits, cfg.block_n)

    q = q if q.stride(-1) == 1 else q.contiguous()
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    kv = kv_cache.view(row_format.torch_dtype)

    out, lse, o_buf, l_buf, so, sl = split_buffers(t, h, d, splits, q.dtype, device)
    if t == 0:
        return out, lse

    interp = interpreting() or device.type != "cuda"
    dot, precision = _dot_dtype(q, row_format, interp)
    block_q = max(_MIN_BLOCK_Q, triton.next_power_of_2(group))
    for lo, hi in grid_slices(t):  # tokens are grid axis 1: at most 65535 per launch
        _sparse_gqa_decode_kernel[(g, hi - lo, splits)](
            q[lo:hi], kv, indices[lo:hi], o_buf[lo:hi], l_buf[lo:hi],
            scale * LOG2E, group, k, kv.shape[1], split_len,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), indices.stride(0),
            so[0], so[1], so[2], sl[0], sl[1], sl[2],
            KV_WIDTH=row_format.kv_width, D=d, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
            DOT=dot, PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, l_buf, out, lse)
    return out, lse


__all__ = [
    "GqaDecodeConfig",
    "default_config",
    "num_splits_for",
    "sparse_gqa_decode_triton",
    "supports",
]
