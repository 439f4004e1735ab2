"""Triton kernels that fuse a layer's small ops: each replaces a chain of torch kernels.

The references are the torch compositions in `hisparse.models.fused` (the eager code of the
model before these kernels), and each kernel keeps their order of operations:

* `rms_norm` (optionally after the residual add): one launch for the add, the fp32 norm, the
  cast back and the weight product (torch: eight kernels). The mean's sum runs in another
  order than torch's, so values may differ from the reference in the last bit.
* `rope`: rotary embedding of a strided ``[N, H, R]`` slice into a contiguous tensor, each
  product, difference and sum rounded to the input dtype as torch rounds them (bit-exact).
* `gqa_rope_write`: a GQA layer's rotary of q and k, its paged K/V row and its fp8 index
  key (SmolLM2's write: ten torch kernels), bit-exact.
* `indexer_fp8`: the lightning indexer's query or key path after its projection: rotary on the
  first ``rope_dim`` values, the Walsh-Hadamard butterfly in fp32 (the reference's own adds
  and subtractions, so bit-exact), power-of-two scales per tile, e4m3 bytes; keys are written
  straight into their pages.
* `write_mla_rows`: the MLA row of each new token: RMS norm of the latent, rotary of its
  rope part, the row format's packing (``fp8_ds_mla`` tiles or ``bf16``) and the paged write.
* `route_dense`, `moe_combine`: the MoE router's grouped top-k and the experts' weighted sum.
* `silu_mul` (libdevice ``expf``, as torch's silu) and `head_weights` (the indexer's fp32
  per-head weights, one GEMV).

e4m3 bytes are encoded with integer operations (round to nearest even, like torch's cast) so
the CPU interpreter, whose float8 cast mis-rounds at exponent carries, runs the same kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from hisparse.runtime.ops import triton_common  # noqa: F401  (the interpreter's loop-bound fix)
from hisparse.runtime.ops.triton_common import grid_dependency_wait, pdl

FP8_MAX = tl.constexpr(448.0)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _bf16_bits(x):
    """fp32 bits of ``x`` rounded to bf16 (nearest even; integer ops, as the interpreter's
    bf16 cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) & -65536


@triton.jit
def _round(x, DT: tl.constexpr):
    """``x`` (fp32) rounded to ``DT`` and widened back: one torch op in dtype ``DT``."""
    y = x
    if DT == tl.bfloat16:  # noqa: SIM300 (DT is the constexpr)
        y = _bf16_bits(x).to(tl.float32, bitcast=True)
    elif DT == tl.float16:  # noqa: SIM300
        y = x.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rotate(x, xp, c, s, first, DT: tl.constexpr):
    """Rotary of element ``x`` with its pair partner ``xp``: the pair's first element becomes
    ``x·c - xp·s``, the second ``x·c + xp·s`` (torch's ``x1·c - x2·s`` / ``x2·c + x1·s``)."""
    a = _round(x * c, DT)
    b = _round(xp * s, DT)
    return tl.where(first, _round(a - b, DT), _round(a + b, DT))


@triton.jit
def _rope_index(d, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(pair partner, angle index, is-first-of-pair) of position ``d < R`` in the rope slice."""
    if INTERLEAVED:
        partner = d ^ 1
        ang = d // 2
        first = (d % 2) == 0
    else:
        half: tl.constexpr = R // 2
        partner = tl.where(d < half, d + half, d - half)
        ang = d % half
        first = d < half
    return partner, ang, first


@triton.jit
def _e4m3_bits(x):
    """e4m3fn byte (as int32) of fp32 ``x`` within ``[-448, 448]``, rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    # subnormals (and the carry into the smallest normal): m · 2^-9, m in 0..8
    v = a * 512.0
    fl = tl.floor(v)
    frac = v - fl
    fli = fl.to(tl.int32)
    sub = fli + ((frac > 0.5) | ((frac == 0.5) & ((fli & 1) == 1))).to(tl.int32)
    # normals: exponent and the top three mantissa bits, rounded to nearest even
    ab = a.to(tl.int32, bitcast=True)
    e = ((ab >> 23) & 0xFF) - 127
    m = (ab >> 20) & 0x7
    low = ab & 0xFFFFF
    up = (low > 0x80000) | ((low == 0x80000) & ((m & 1) == 1))
    norm = ((e + 7) << 3) + m + up.to(tl.int32)  # a mantissa carry moves into the exponent
    out = tl.where(a < 0.015625, sub, norm)
    out = tl.where(a != a, 0x7F, out)
    return out | sign


@triton.jit
def _ceil_pow2(s):
    """The smallest power of two ``>= s`` for finite ``s > 0`` (DeepSeek's ue8m0 scales)."""
    b = s.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store_f32_bytes(ptr, v, mask):
    """Store fp32 ``v [n]`` as 4 little-endian bytes each at ``ptr [n, 4]``."""
    b = v.to(tl.int32, bitcast=True)
    k = tl.arange(0, 4)
    byte = (b[:, None] >> (8 * k[None, :])) & 0xFF
    tl.store(ptr + 4 * tl.arange(0, v.shape[0])[:, None] + k[None, :], byte.to(tl.uint8), mask)


@triton.jit
def _store_bf16_bytes(ptr, v, mask):
    """Store ``v [n]`` rounded to bf16 as 2 little-endian bytes each at ``ptr [n, 2]``."""
    b = _bf16_bits(v)
    k = tl.arange(0, 2)
    byte = (b[:, None] >> (16 + 8 * k[None, :])) & 0xFF
    tl.store(ptr + 2 * tl.arange(0, v.shape[0])[:, None] + k[None, :], byte.to(tl.uint8), mask)


def _angles(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(cos, sin, row stride)`` as the rotary kernels read them: rows of unit stride, the
    same row stride for both (views of one ``[N, 2, R / 2]`` table row pass as they are)."""
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, cos.stride(0)


# ---------------------------------------------------------------------------------------------
# RMS norm
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, x_stride, r_ptr, r_stride, s_ptr, o_ptr, w_ptr, D, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, OUT_DT: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    h = tl.load(x_ptr + row * x_stride + d, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * r_stride + d, mask=m, other=0.0).to(tl.float32)
        h = _round(h + r, DT)
        tl.store(s_ptr + row * D + d, h.to(DT), mask=m)
    ms = tl.sum(h * h, axis=0) / D
    y = _round(h * tl.math.rsqrt(ms + eps), DT)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * D + d, _round(w * y, OUT_DT).to(OUT_DT), mask=m)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor | None, Tensor]:
    """``(x + residual or None, RMSNorm(x + residual))`` of rows ``x [N, D]`` (row-strided)."""
    n, d = x.shape
    out = torch.empty((n, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty((n, d), dtype=x.dtype, device=x.device) if residual is not None else None
    if n:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(n,)](
            x, x.stride(0), residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0, s if s is not None else out,
            out, weight, d, eps, HAS_RES=residual is not None, BLOCK=block,
            DT=_TL_DTYPES[x.dtype], OUT_DT=_TL_DTYPES[out.dtype],
            num_warps=max(1, min(16, block // 256)), **pdl(x.device),
        )  # fmt: skip
    return s, out


# ---------------------------------------------------------------------------------------------
# Rotary
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(
    x_ptr, sx_n, sx_h, cos_ptr, sin_ptr, cs_stride, o_ptr, H,
    R: tl.constexpr, BH: tl.constexpr, INTERLEAVED: tl.constexpr, DT: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, R)
    partner, ang, first = _rope_index(d, R, INTERLEAVED)
    m = (h < H)[:, None]
    base = x_ptr + n * sx_n + h[:, None] * sx_h
    x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + n * cs_stride + ang).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + n * cs_stride + ang).to(tl.float32)[None, :]
    o = _rotate(x, xp, c, s, first[None, :], DT)
    tl.store(o_ptr + (n * H + h[:, None]) * R + d[None, :], o.to(DT), mask=m)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary of ``x [N, H, R]`` (last dim contiguous) -> contiguous ``[N, H, R]``."""
    n, h, r = x.shape
    out = torch.empty((n, h, r), dtype=x.dtype, device=x.device)
    if n:
        bh = min(16, triton.next_power_of_2(h))
        _rope_kernel[(n, triton.cdiv(h, bh))](
            x, x.stride(0), x.stride(1), *_angles(cos, sin), out, h,
            R=r, BH=bh, INTERLEAVED=interleaved, DT=_TL_DTYPES[x.dtype], **pdl(x.device),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# GQA rows: rotary of q and k + the paged K/V row + the fp8 index key
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gqa_rows_kernel(
    x_ptr, sx_n, cos_ptr, sin_ptr, cs_stride, q_ptr, H, G,
    slot_ptr, row_ptr, s_rb, s_ro, row_bs, islot_ptr, key_ptr, s_kb, s_ko, key_bs,
    D: tl.constexpr, BH: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)  # q heads, then k heads, then v heads
    d = tl.arange(0, D)
    partner, ang, first = _rope_index(d, D, False)
    hm = (h < H + 2 * G)[:, None]
    base = x_ptr + n * sx_n + h[:, None] * D
    x = tl.load(base + d[None, :], mask=hm, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=hm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + n * cs_stride + ang).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + n * cs_stride + ang).to(tl.float32)[None, :]
    rotated = (h < H + G)[:, None]
    o = tl.where(rotated, _rotate(x, xp, c, s, first[None, :], DT), x)
    tl.store(q_ptr + (n * H + h[:, None]) * D + d[None, :], o.to(DT), mask=(h < H)[:, None])
    col = (h[:, None] - H) * D + d[None, :]  # the row holds the k heads, then the v heads
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        row = row_ptr + (slot // row_bs) * s_rb + (slot % row_bs) * s_ro
        tl.store(row + col, o.to(DT), mask=hm & (h >= H)[:, None])
    islot = tl.load(islot_ptr + n).to(tl.int64)
    if islot >= 0:
        key = key_ptr + (islot // key_bs) * s_kb + (islot % key_bs) * s_ko
        e4m3 = _e4m3_bits(tl.minimum(tl.maximum(o, -FP8_MAX), FP8_MAX)).to(tl.uint8)
        tl.store(key + col, e4m3, mask=rotated & (h >= H)[:, None])


def gqa_rope_write(
    qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, sin: Tensor,
    rows: Tensor, slots: Tensor, keys: Tensor, key_slots: Tensor,
) -> Tensor:  # fmt: skip
    """From ``qkv [N, (H + 2G) · D]`` (the stacked projection: q, k, v heads): the rotated
    queries ``[N, H, D]``; the rotated k and v as rows ``[k heads, v heads]`` into ``rows
    [NB, BS, 2 · G · D]`` (``qkv``'s dtype) at ``slots``, the rotated k as e4m3 into ``keys
    [NB, BS, G · D]`` (uint8) at ``key_slots`` (``< 0`` skipped)."""
    n = qkv.shape[0]
    d = rows.shape[2] // (2 * kv_heads)
    q = torch.empty((n, heads, d), dtype=qkv.dtype, device=qkv.device)
    if n:
        width = heads + 2 * kv_heads
        bh = min(16, triton.next_power_of_2(width))
        _gqa_rows_kernel[(n, triton.cdiv(width, bh))](
            qkv, qkv.stride(0), *_angles(cos, sin), q, heads, kv_heads,
            slots.contiguous(), rows, rows.stride(0), rows.stride(1), rows.shape[1],
            key_slots.contiguous(), keys, keys.stride(0), keys.stride(1), keys.shape[1],
            D=d, BH=bh, DT=_TL_DTYPES[qkv.dtype], **pdl(qkv.device),
        )  # fmt: skip
    return q


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
# MLA rows: RMS norm of the latent + rotary of the rope part + packing + paged write
# ---------------------------------------------------------------------------------------------
@triton.jit
def _mla_rows_kernel(
    kv_ptr, kv_stride, w_ptr, eps, cos_ptr, sin_ptr, cs_stride, slot_ptr, view_ptr, s_blk, s_off,
    block_size,
    C: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, FP8: tl.constexpr,
    DT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        c = tl.arange(0, C)
        h = tl.load(kv_ptr + n * kv_stride + c).to(tl.float32)
        ms = tl.sum(h * h, axis=0) / C
        y = _round(h * tl.math.rsqrt(ms + eps), DT)
        w = tl.load(w_ptr + c).to(tl.float32)
        lat = _round(w * y, DT)
        d = tl.arange(0, R)
        partner, ang, first = _rope_index(d, R, True)
        rb = kv_ptr + n * kv_stride + C
        xr = tl.load(rb + d).to(tl.float32)
        xp = tl.load(rb + partner).to(tl.float32)
        cs = tl.load(cos_ptr + n * cs_stride + ang).to(tl.float32)
        sn = tl.load(sin_ptr + n * cs_stride + ang).to(tl.float32)
        rot = _rotate(xr, xp, cs, sn, first, DT)
        row = view_ptr + (slot // block_size) * s_blk + (slot % block_size) * s_off
        if FP8:
            NT: tl.constexpr = C // TILE
            lt = tl.reshape(lat, [NT, TILE])
            amax = tl.max(tl.abs(lt), axis=1)
            scale = amax * (1.0 / 448.0)
            safe = tl.where(scale > 0, scale, 1.0)
            q = tl.minimum(tl.maximum(tl.math.div_rn(lt, safe[:, None]), -FP8_MAX), FP8_MAX)
            tl.store(row + c, tl.reshape(_e4m3_bits(q), [C]).to(tl.uint8))
            _store_f32_bytes(row + C, scale, True)
            _store_bf16_bytes(row + C + 4 * NT, rot, True)
        else:
            _store_bf16_bytes(row, lat, True)
            _store_bf16_bytes(row + 2 * C, rot, True)


def write_mla_rows(
    kv: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, view: Tensor,
    slots: Tensor, fp8: bool, tile: int = 128,
) -> None:  # fmt: skip
    """New rows from ``kv [N, C + R]`` (the latent projection) into ``view [NB, BS, row]``."""
    n = kv.shape[0]
    c = weight.shape[0]
    r = kv.shape[1] - c
    if n:
        _mla_rows_kernel[(n,)](
            kv, kv.stride(0), weight, eps, *_angles(cos, sin), slots.contiguous(), view,
            view.stride(0), view.stride(1), view.shape[1],
            C=c, R=r, TILE=tile, FP8=fp8, DT=_TL_DTYPES[kv.dtype], num_warps=4,
            **pdl(kv.device),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# MoE: the router's grouped top-k, and the combine of the experts' outputs
# ---------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(
    score_ptr, x_ptr, s_x, rw_ptr, H, bias_ptr, w_ptr, chosen_ptr, scaling,
    E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    NORM: tl.constexpr, FROM_X: tl.constexpr, BH: tl.constexpr, LIBDEVICE: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    if FROM_X:  # the scores from the row: an fp32 GEMV over the router weight, then sigmoid
        acc = tl.zeros([E, BH], dtype=tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            m = hh < H
            xv = tl.load(x_ptr + n * s_x + hh, mask=m, other=0.0).to(tl.float32)
            wv = tl.load(rw_ptr + e[:, None] * H + hh[None, :], mask=m[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        logit = tl.sum(acc, axis=1)
        if LIBDEVICE:  # noqa: SIM108  expf, as torch's sigmoid (Triton's exp is ex2.approx)
            ex = libdevice.exp(-logit)
        else:
            ex = tl.exp(-logit)
        s = tl.math.div_rn(1.0, 1.0 + ex)
    else:
        s = tl.load(score_ptr + n * E + e)
    c = s + tl.load(bias_ptr + e)
    EG: tl.constexpr = E // G
    cg = tl.reshape(c, [G, EG])
    j = tl.arange(0, EG)[None, :]
    first = tl.argmax(cg, axis=1)
    gs = tl.max(cg, axis=1)
    if EG > 1:  # a group's score: its two best bias-corrected scores
        gs = gs + tl.max(tl.where(j == first[:, None], float("-inf"), cg), axis=1)
    gi = tl.arange(0, G)
    keep = gi < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(tl.where(keep, float("-inf"), gs), axis=0)
        keep = keep | (gi == best)
    ce = tl.reshape(tl.where(keep[:, None], cg, float("-inf")), [E])
    chosen = e < 0
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(tl.where(chosen, float("-inf"), ce), axis=0)
        chosen = chosen | (e == best)
    w = tl.where(chosen, s, 0.0)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=0) + 1e-20)
    tl.store(w_ptr + n * E + e, w * scaling)
    tl.store(chosen_ptr + n * E + e, chosen.to(tl.int8))


def route_dense(
    scores: Tensor, bias: Tensor, n_group: int, topk_group: int, top_k: int, norm: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """DeepSeek's grouped top-k routing from sigmoid ``scores [N, E]`` (fp32, torch's sigmoid:
    the kernel's own exp would be approximate) -> ``(weights [N, E] fp32, 0 where not chosen;
    chosen [N, E] bool)``. Ties go to the lowest expert or group."""
    n, e = scores.shape
    w = torch.empty((n, e), dtype=torch.float32, device=scores.device)
    chosen = torch.empty((n, e), dtype=torch.int8, device=scores.device)
    if n:
        _route_kernel[(n,)](
            scores.contiguous(), scores, 0, scores, 0, bias.float().contiguous(), w, chosen,
            scaling, E=e, G=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, NORM=norm,
            FROM_X=False, BH=1, LIBDEVICE=False, num_warps=1, **pdl(scores.device),
        )  # fmt: skip
    return w, chosen.view(torch.bool)


def route_dense_rows(
    x: Tensor, weight: Tensor, bias: Tensor, n_group: int, topk_group: int, top_k: int,
    norm: bool, scaling: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`route_dense` from the rows ``x [N, H]`` themselves: one program per row computes its
    scores ``sigmoid(x · weight.T)`` in fp32 (``weight [E, H]``; the GEMV's sum order is the
    kernel's, so a score may differ from cuBLAS's in its last bits) before routing them. One
    launch instead of a cast, a GEMV and a sigmoid; for small ``E · H`` only (each program
    reads the whole weight), which `fused.route_dense` checks."""
    n, h = x.shape
    e = weight.shape[0]
    w = torch.empty((n, e), dtype=torch.float32, device=x.device)
    chosen = torch.empty((n, e), dtype=torch.int8, device=x.device)
    if n:
        # Wide tiles, few iterations: one program per row is latency-bound on its loop of
        # loads (a [E, 512] tile a trip made it the step's slowest small kernel on the H200).
        bh = max(16, min(triton.next_power_of_2(h), 16384 // e))
        _route_kernel[(n,)](
            w, x, x.stride(0), weight.contiguous(), h, bias.float().contiguous(), w, chosen,
            scaling, E=e, G=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, NORM=norm,
            FROM_X=True, BH=bh, LIBDEVICE=x.is_cuda, num_warps=8, **pdl(x.device),
        )  # fmt: skip
    return w, chosen.view(torch.bool)


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, chosen_ptr, shared_ptr, o_ptr, N, H,
    E: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = h < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for e in range(E):  # ascending experts, rounded after each add: the loop's sum
        w = tl.load(w_ptr + n * E + e)
        pick = tl.load(chosen_ptr + n * E + e) != 0
        y = tl.load(y_ptr + (e * N + n) * H + h, mask=m & pick, other=0.0).to(tl.float32)
        acc = tl.where(pick, _round(acc + _round(y * w, DT), DT), acc)
    shared = tl.load(shared_ptr + n * H + h, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + n * H + h, _round(acc + shared, DT).to(DT), mask=m)


def moe_combine(y: Tensor, w: Tensor, chosen: Tensor, shared: Tensor) -> Tensor:
    """``Σ_e chosen · (y[e] · w[:, e])`` plus ``shared``: the MoE's output from the experts'
    ``y [E, N, H]``, each term and each partial sum rounded to ``y``'s dtype in ascending
    expert order (the per-expert loop's order)."""
    e, n, h = y.shape
    out = torch.empty((n, h), dtype=y.dtype, device=y.device)
    if n:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(n, triton.cdiv(h, block))](
            y.contiguous(), w.contiguous(), chosen.contiguous().view(torch.int8),
            shared.contiguous(), out, n, h, E=e, BLOCK=block, DT=_TL_DTYPES[y.dtype],
            **pdl(y.device),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# MLP activation, indexer head weights
# ---------------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(
    x_ptr, x_stride, o_ptr, inter,
    BLOCK: tl.constexpr, DT: tl.constexpr, LIBDEVICE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    g = tl.load(x_ptr + row * x_stride + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + inter + i, mask=m, other=0.0).to(tl.float32)
    if LIBDEVICE:  # noqa: SIM108  expf, as torch's silu (Triton's exp is ex2.approx on CUDA)
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = _round(tl.math.div_rn(g, 1.0 + e), DT)
    tl.store(o_ptr + row * inter + i, _round(act * u, DT).to(DT), mask=m)


def silu_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` of rows ``x [..., 2I]`` (the last dim contiguous,
    the rows evenly strided), each op rounded to ``x``'s dtype as torch rounds it."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, rows.stride(0), out, inter, BLOCK=block, DT=_TL_DTYPES[x.dtype],
            LIBDEVICE=x.is_cuda, **pdl(x.device),
        )  # fmt: skip
    return out


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
