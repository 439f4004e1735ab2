"""Triton kernels that fuse a layer's small ops: each replaces a chain of torch kernels.

The references are the torch compositions in `hisparse.models.fused` (the eager code of the
model before these kernels), and each kernel keeps their order of operations. This module
holds the norm, the rotary and the cache-row writes, and the bit helpers that the lightning
indexer's kernels (`fused_indexer_triton`) and the feed-forward's (`fused_ffn_triton`) share:

* `rms_norm` (optionally after the residual add): one launch for the add, the fp32 norm, the
  cast back and the weight product (torch: eight kernels). The mean's sum runs in another
  order than torch's, so values may differ from the reference in the last bit.
* `rope`: rotary embedding of a strided ``[N, H, R]`` slice into a contiguous tensor, each
  product, difference and sum rounded to the input dtype as torch rounds them (bit-exact).
* `gqa_rope_write`: a GQA layer's rotary of q and k, its paged K/V row and its fp8 index
  key (SmolLM2's write: ten torch kernels), bit-exact.
* `write_mla_rows`: the MLA row of each new token: RMS norm of the latent, rotary of its
  rope part, the row format's packing (``fp8_ds_mla`` tiles or ``bf16``) and the paged write.

e4m3 bytes are encoded with integer operations (round to nearest even, like torch's cast) so
the CPU interpreter, whose float8 cast mis-rounds at exponent carries, runs the same kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

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
