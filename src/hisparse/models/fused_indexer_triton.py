"""Triton kernels of the lightning indexer's small ops, split from `fused_triton` (whose
rotary and e4m3 helpers they use) so that the indexer's kernels read together; the references
are the torch compositions in `hisparse.models.fused`:

* `indexer_fp8`: the lightning indexer's query or key path after its projection: rotary on the
  first ``rope_dim`` values, the Walsh-Hadamard butterfly in fp32 (the reference's own adds
  and subtractions, so bit-exact), power-of-two scales per tile, e4m3 bytes; keys are written
  straight into their pages.
* `head_weights`: the indexer's fp32 per-head weights, one GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.models.fused_triton import (
    _TL_DTYPES,
    FP8_MAX,
    _angles,
    _ceil_pow2,
    _e4m3_bits,
    _rope_index,
    _rotate,
    _round,
)
from hisparse.runtime.ops.triton_common import grid_dependency_wait, pdl


# ---------------------------------------------------------------------------------------------
# Lightning indexer: rotary + Hadamard + e4m3 tiles (+ the key write)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _hadamard(x, BR: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """Sylvester-ordered Walsh-Hadamard butterfly of the rows of ``x [BR, D]`` (unscaled)."""
    for stage in tl.static_range(LOG_D):
        y = tl.permute(tl.reshape(x, [BR, D // (2 << stage), 2, 1 << stage]), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [BR, D])
    return x


@triton.jit
def _indexer_fp8_kernel(
    x_ptr, sx_tok, sx_head, heads, rows, cos_ptr, sin_ptr, cs_stride, out_ptr, scale_ptr,
    slot_ptr, page_stride, block_size, scale_val, nw_ptr, nb_ptr, norm_eps,
    D: tl.constexpr, LOG_D: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr,
    BR: tl.constexpr, INTERLEAVED: tl.constexpr, DT: tl.constexpr, TO_PAGES: tl.constexpr,
    NORM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = row < rows
    tok = (row // heads).to(tl.int64)
    d = tl.arange(0, D)
    in_rope = d < R
    partner, ang, first = _rope_index(d, R, INTERLEAVED)
    partner = tl.where(in_rope, partner, d)
    base = x_ptr + (tok * sx_tok + (row - tok * heads) * sx_head)[:, None]
    x = tl.load(base + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    if NORM:  # the keys' LayerNorm (fp32 statistics, one rounding to DT), partners alike
        mean = tl.sum(x, axis=1) / D
        dx = x - mean[:, None]
        rstd = tl.math.rsqrt(tl.sum(dx * dx, axis=1) / D + norm_eps)[:, None]
        wd, bd = tl.load(nw_ptr + d).to(tl.float32), tl.load(nb_ptr + d).to(tl.float32)
        wp, bp = tl.load(nw_ptr + partner).to(tl.float32), tl.load(nb_ptr + partner).to(tl.float32)
        x = _round(wd[None, :] * (rstd * dx) + bd[None, :], DT)
        xp = _round(wp[None, :] * (rstd * (xp - mean[:, None])) + bp[None, :], DT)
    cm = rm[:, None] & in_rope[None, :]
    c = tl.load(cos_ptr + tok[:, None] * cs_stride + ang[None, :], mask=cm, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * cs_stride + ang[None, :], mask=cm, other=0.0)
    rot = _rotate(x, xp, c.to(tl.float32), s.to(tl.float32), first[None, :], DT)
    y = tl.where(in_rope[None, :], rot, x)
    y = _hadamard(y, BR, D, LOG_D) * scale_val
    NT: tl.constexpr = D // TILE
    yt = tl.reshape(y, [BR, NT, TILE])
    amax = tl.maximum(tl.max(tl.abs(yt), axis=2), 1e-4)  # FP8_INDEXER_MIN_AMAX
    scale = _ceil_pow2(amax * (1.0 / 448.0))
    q = tl.minimum(tl.maximum(tl.math.div_rn(yt, scale[:, :, None]), -FP8_MAX), FP8_MAX)
    qb = tl.reshape(_e4m3_bits(q), [BR, D]).to(tl.uint8)
    j = tl.arange(0, NT)
    if TO_PAGES:
        slot = tl.load(slot_ptr + row, mask=rm, other=-1).to(tl.int64)
        keep = rm & (slot >= 0)
        blk, off = slot // block_size, slot % block_size
        page = out_ptr + blk * page_stride
        tl.store(page[:, None] + off[:, None] * D + d[None, :], qb, mask=keep[:, None])
        sc = page + block_size * D + off * (4 * NT)  # [BR] first scale byte of each row
        k = tl.arange(0, 4)
        sb = (scale.to(tl.int32, bitcast=True)[:, :, None] >> (8 * k[None, None, :])) & 0xFF
        tl.store(
            sc[:, None, None] + 4 * j[None, :, None] + k[None, None, :],
            sb.to(tl.uint8),
            mask=keep[:, None, None],
        )
    else:
        tl.store(out_ptr + row.to(tl.int64)[:, None] * D + d[None, :], qb, mask=rm[:, None])
        tl.store(scale_ptr + row.to(tl.int64)[:, None] * NT + j[None, :], scale, rm[:, None])


def _indexer_launch(
    x: Tensor, heads: int, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool,
    tile: int, out: Tensor, scale: Tensor | None, slots: Tensor | None, block_size: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
) -> None:  # fmt: skip
    """``x``: ``[N, heads, D]`` or, with one head, ``[N, D]``; unit stride in ``D``."""
    d = x.shape[-1]
    rows = x.shape[0] * heads
    if not rows:
        return
    # Rows per program: up to 16, fewer for a decode step's few rows so that they spread over
    # some 64 programs (each program's Hadamard stages cost per row it holds).
    br = max(2, min(16, triton.next_power_of_2(triton.cdiv(rows, 64))))
    _indexer_fp8_kernel[(triton.cdiv(rows, br),)](
        x, x.stride(0), x.stride(1) if x.dim() == 3 else 0, heads, rows, *_angles(cos, sin), out,
        scale if scale is not None else out, slots if slots is not None else out,
        out.stride(0) if slots is not None else 0, block_size, d**-0.5,
        *(norm if norm is not None else (x, x, 0.0)),
        D=d, LOG_D=d.bit_length() - 1, R=rope_dim, TILE=tile, BR=br,
        INTERLEAVED=interleaved, DT=_TL_DTYPES[x.dtype], TO_PAGES=slots is not None,
        NORM=norm is not None, **pdl(x.device),
    )  # fmt: skip


def indexer_fp8_query(
    q: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool, tile: int
) -> tuple[Tensor, Tensor]:
    """``q [N, H, D]`` (unit stride in ``D``; a slice of a stacked projection's rows too) ->
    (e4m3 ``[N, H, D]``, scales ``[N, H, D / tile]``)."""
    n, h, d = q.shape
    out = torch.empty((n, h, d), dtype=torch.float8_e4m3fn, device=q.device)
    scale = torch.empty((n, h, d // tile), dtype=torch.float32, device=q.device)
    _indexer_launch(q, h, cos, sin, rope_dim, interleaved, tile, out.view(torch.uint8),
                    scale, None, 0)  # fmt: skip
    return out, scale


def indexer_fp8_write_keys(
    k: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool, tile: int,
    pages: Tensor, block_size: int, slots: Tensor,
    norm: tuple[Tensor, Tensor, float] | None = None,
) -> None:  # fmt: skip
    """Keys ``k [N, D]`` (``norm``: LayerNorm ``(weight, bias, eps)`` first) rotated,
    transformed and quantized into ``pages`` at ``slots``."""
    _indexer_launch(k, 1, cos, sin, rope_dim, interleaved, tile, pages, None,
                    slots.contiguous(), block_size, norm)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Indexer head weights
# ---------------------------------------------------------------------------------------------
#: Rows from which `head_weights` takes tiles of rows (see `head_weights_tile`).
HEAD_WEIGHTS_ROW_TILES = 8


@triton.jit
def _head_weights_kernel(
    x_ptr, x_stride, w_ptr, o_ptr, N, K, H, scale,
    BN: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < N
    hm = heads < H
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
    w_rows = w_ptr + heads[:, None].to(tl.int64) * K
    acc = tl.zeros([BN, BH, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        x = tl.load(x_rows + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=hm[:, None] & km[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    out = tl.sum(acc, axis=2) * scale
    tl.store(o_ptr + rows[:, None] * H + heads[None, :], out, mask=rm[:, None] & hm[None, :])


def head_weights_tile(n: int) -> tuple[int, int, int, int]:
    """``(rows, heads, K step, warps)`` of one program of `head_weights` for ``n`` rows. Past
    `HEAD_WEIGHTS_ROW_TILES` rows, a tile of rows times heads, each weight row read once per
    row block (one program per (row, head) read the 1.8 MB weight once per row: at 29 rows of
    K 7168, 53 MB from L2, measured slower on the H200, docs/benchmarks.md §4). Up to it, one
    program per (row, head) and a whole weight row in one load, which the few rows' latency
    favours (at one row it measured faster than the tiles)."""
    if n <= HEAD_WEIGHTS_ROW_TILES:
        return 1, 1, 8192, 8
    return 8, 2, 1024, 8


def head_weights(x: Tensor, weight: Tensor, scale: float) -> Tensor:
    """``(x.float() @ weight.T) * scale``: the indexer's per-head weights ``[N, H]`` fp32 from
    rows ``x [N, K]`` and the fp32 ``weight [H, K]`` (one launch: torch runs a cast, a GEMV
    and its reduction, and the scale). The dot products sum in another order than cuBLAS."""
    n, k = x.shape
    h = weight.shape[0]
    out = torch.empty((n, h), dtype=torch.float32, device=x.device)
    if n:
        bn, bh, bk, warps = head_weights_tile(n)
        _head_weights_kernel[(triton.cdiv(n, bn), triton.cdiv(h, bh))](
            x, x.stride(0), weight.contiguous(), out, n, k, h, scale, BN=bn, BH=bh,
            BK=min(bk, triton.next_power_of_2(k)), num_warps=warps, **pdl(x.device),
        )  # fmt: skip
    return out
