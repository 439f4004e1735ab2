"""Triton kernels of the W8A8 block-scaled fp8 path (references in `hisparse.models.fp8`).

* `act_quant`: per-token activation quantization in 128-column groups, bit-exact against the
  reference (the scale's product and power-of-two rounding, an IEEE division, the clamp to ±448,
  e4m3 bytes encoded by integer ops as `fused_triton` does: the interpreter's float8 cast
  mis-rounds at exponent carries).
* `block_gemm`: ``[M, K] e4m3 x [N, K] e4m3 -> [M, N]``, one 128-wide K block per step: the
  block's fp32 dot product times the activation's and the weight's scale, added in order.
* `grouped_gemm`: the same over a MoE's (token, expert) pairs sorted by expert (`moe_align`):
  each program's rows share one expert, padding slots are skipped, output rows land at their
  pair's index; the grid is fixed by the pair count, so a decode step needs no host sync.

Both GEMMs differ from the reference only in the order of the fp32 sums inside a K block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.models.fp8 import BLOCK, cdiv
from hisparse.models.fused_triton import _TL_DTYPES, _ceil_pow2, _e4m3_bits, _round
from hisparse.runtime.ops import triton_common  # noqa: F401  (the interpreter's loop-bound fix)
from hisparse.runtime.ops.triton_common import next_pow2

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _act_quant_kernel(
    x_ptr, sx_m, q_ptr, s_ptr, M, K, KT,
    POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    g = tl.program_id(1)
    cols = g * BK + tl.arange(0, BK)
    r_ok = rows < M
    mask = r_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sx_m + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    s = amax * (1.0 / 448.0)
    if POW2:
        s = _ceil_pow2(s)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], _e4m3_bits(y).to(tl.uint8), mask=mask)
    tl.store(s_ptr + r64 * KT + g, s, mask=r_ok)


def act_quant(x: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """``(e4m3 [M, K], fp32 [M, ceil(K / 128)])`` of rows ``x [M, K]`` (unit column stride)."""
    m, k = x.shape
    kt = cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, kt), dtype=torch.float32, device=x.device)
    if m and k:
        bm = 4
        _act_quant_kernel[(cdiv(m, bm), kt)](
            x, x.stride(0), q, s, m, k, kt, POW2=pow2, BM=bm, BK=BLOCK, num_warps=4
        )
    return q.view(torch.float8_e4m3fn), s


@triton.jit
def _gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, slots_ptr, bexp_ptr,
    M, N, K, KT, E, s_am, s_sam, s_be, s_bn, s_sbe, s_sbn, s_cm, ROW_OFF, A_DIV,
    GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    OUT_DT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    if GROUPED:
        e = tl.load(bexp_ptr + pid_m)
        if e >= E:  # a block past the last expert's padded rows
            return
        slot = tl.load(slots_ptr + pid_m * BM + tl.arange(0, BM))
        m_ok = slot < M  # padding slots hold M
        a_row = (slot // A_DIV).to(tl.int64)
        c_row = slot.to(tl.int64)
        b_base = b_ptr + e.to(tl.int64) * s_be
        sb_base = sb_ptr + e.to(tl.int64) * s_sbe
    else:
        rows = pid_m * BM + tl.arange(0, BM)
        m_ok = rows < M
        a_row = rows.to(tl.int64)
        c_row = a_row
        b_base = b_ptr
        sb_base = sb_ptr
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    srow = ((offs_n + ROW_OFF) // BK).to(tl.int64)  # the weight row's scale tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KT):
        offs_k = kb * BK + tl.arange(0, BK)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] * s_am + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + n64[:, None] * s_bn + offs_k[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        sa = tl.load(sa_ptr + a_row * s_sam + kb, mask=m_ok, other=0.0)
        sb = tl.load(sb_base + srow * s_sbn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    out = _round(acc, OUT_DT).to(OUT_DT)
    tl.store(c_ptr + c_row[:, None] * s_cm + n64[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int) -> tuple[int, int]:
    """``(BM, BN)``: rows a program takes (16 to 64, by the batch) and output columns."""
    return min(64, max(16, next_pow2(m))), 128 if n > 64 else 64


def _check_weight(qw: Tensor, sw: Tensor) -> None:
    if qw.dtype != torch.float8_e4m3fn or qw.stride(-1) != 1:
        raise ValueError(f"fp8 GEMM: weight must be contiguous e4m3, got {qw.dtype}")
    if sw.dtype != torch.float32:
        raise ValueError(f"fp8 GEMM: weight scales must be fp32, got {sw.dtype}")


def block_gemm(
    qx: Tensor,
    sx: Tensor,
    qw: Tensor,
    sw: Tensor,
    row_offset: int = 0,
    out_dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """``[M, N]`` in ``out_dtype`` (contract of `hisparse.models.fp8.block_gemm`); ``out``: a
    row-strided destination to write instead of a new tensor."""
    _check_weight(qw, sw)
    m, k = qx.shape
    n = qw.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m and n:
        bm, bn = _tiles(m, n)
        _gemm_kernel[(cdiv(m, bm), cdiv(n, bn))](
            qx, sx, qw, sw, out, qx, qx, m, n, k, cdiv(k, BLOCK), 0,
            qx.stride(0), sx.stride(0), 0, qw.stride(0), 0, sw.stride(0), out.stride(0),
            row_offset, 1, GROUPED=False, BM=bm, BN=bn, BK=BLOCK,
            OUT_DT=_TL_DTYPES[out.dtype], num_warps=4, num_stages=3,
        )  # fmt: skip
    return out


def grouped_gemm(
    qa: Tensor,
    sa: Tensor,
    slots: Tensor,
    block_expert: Tensor,
    block_m: int,
    qw: Tensor,
    sw: Tensor,
    out: Tensor,
    *,
    a_div: int = 1,
    row_offset: int = 0,
) -> Tensor:
    """``out[p] = A[p // a_div] @ W[e(p)].T`` for every (token, expert) pair ``p`` of
    `moe_align`'s ``slots`` (``block_expert``: each ``block_m`` slots' expert, ``>= E`` past
    the last one). ``qa [R, K]`` / ``sa [R, Kt]``: quantized rows (tokens with ``a_div`` =
    experts per token, or the pairs themselves); ``qw [E, N, K]`` / ``sw [E, Nt, Kt]``;
    ``out [P, N]`` row-strided (a column slice of a wider buffer works)."""
    _check_weight(qw, sw)
    p, n = out.shape
    e, _, k = qw.shape
    if p and n:
        bn = 128 if n > 64 else 64
        _gemm_kernel[(block_expert.numel(), cdiv(n, bn))](
            qa, sa, qw, sw, out, slots, block_expert, p, n, k, cdiv(k, BLOCK), e,
            qa.stride(0), sa.stride(0), qw.stride(0), qw.stride(1), sw.stride(0), sw.stride(1),
            out.stride(0), row_offset, a_div, GROUPED=True, BM=block_m, BN=bn, BK=BLOCK,
            OUT_DT=_TL_DTYPES[out.dtype], num_warps=4, num_stages=3,
        )  # fmt: skip
    return out
