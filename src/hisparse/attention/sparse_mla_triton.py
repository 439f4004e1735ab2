"""Triton sparse MLA decode over physical row indices; `sparse_mla_decode_reference` is the oracle.

Absorbed (MQA) form: every query head attends to the same ``top_k`` rows of one shared KV
head, so a program takes a block of ``BLOCK_H`` heads of one token, gathers each KV row once
into registers/shared memory and reuses it for all of those heads (``[BLOCK_H, 576] x
[576, BLOCK_N]`` for the scores, ``[BLOCK_H, BLOCK_N] x [BLOCK_N, 512]`` for the values).

Work is split over the top-k (flash-decoding): program ``(head block, token, split)`` runs an
online softmax over its slice of the indices and, when there is more than one split, writes
an fp32 partial (normalised output and its log-sum-exp); a second kernel combines the splits.
With one split the first kernel writes the final output directly (no partial traffic). A
prefill chunk of more than 65535 tokens (CUDA's grid axis 1 limit) runs as several launches
over slices of its tokens (`triton_split.grid_slices`); token offsets are int64 in the kernel.

The kernel, `_sparse_mla_wide_kernel`, stages whole
``[BLOCK_N, 512]`` latent tiles (64 heads x 64 rows, 8 warps, 2 stages: 221 KB of shared
memory, one program per SM), so the scores are one ``K = 512`` dot plus the RoPE dot and the
values one ``N = 512`` dot; fp8 rows are dequantised to bf16 (``bf16(k8 * scale)``, as
FlashMLA does) once per row for the 64 heads. Triton gives a chained score dot ``[8, 1]``
warps, so both warpgroups compute the same 64-head score tile: more matrix work than the
scores need (docs/benchmarks.md §9). A kernel of four 128-wide tiles that kept the fp8 scales
exact measured slower and was removed (docs/benchmarks.md §9).

Row decoding happens in the kernel, on the same bytes `row_formats` writes:

- ``fp8_ds_mla``: the latent is four 128-wide e4m3 tiles with one fp32 scale each, each value
  dequantised to bf16 (``bf16(k8 * scale)``) as it is staged, then used by the dots like a
  bf16 row (the rounding puts the log-sum-exp within ~1e-3 of the exact one).
- ``bf16``: latent and RoPE read as bf16.

Numerics: dots take bf16 operands (q, the rows, and the probabilities ``p``) and accumulate in
fp32; the softmax runs in fp32 in base 2. Under Triton's CPU interpreter (CI) the dots run in
fp32 instead (the interpreter's bf16 dot is wrong and its bf16 casts truncate), so the CPU
tests check the indexing and the softmax tightly and the GPU tests check the bf16 error.

No host synchronisation and no data-dependent shapes: the split count depends on shapes only,
so a decode step calling this can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hisparse.attention.triton_split import (
    combine_splits,
    grid_slices,
    num_sms,
    split_buffers,
    split_length,
)
from hisparse.kv.row_formats import MlaFormat, mla_format_name, mla_row_bytes
from hisparse.runtime.ops.triton_common import interpreting  # also its interpreter fix

Tensor = torch.Tensor

#: Latent width and RoPE width the kernel is written for (DeepSeek-V3.2 and GLM-5).
LATENT_DIM = 512
ROPE_DIM = 64
_TILE = 128
#: log2(e): the kernels run the softmax in base 2.
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the decode kernel (benchmarks sweep these; `default_config` picks one):
    whole 512-wide latent tiles, fp8 rows dequantised to bf16 (``bf16(k8 * scale)``) before
    the dots."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def default_config(num_tokens: int, num_heads: int) -> DecodeConfig:
    """Tile shape used when the caller gives none (chosen from benchmarks/bench_sparse_mla.py)."""
    del num_tokens, num_heads
    return DecodeConfig()


def supports(q_latent: Tensor, q_rope: Tensor, kv_cache: Tensor, row_format: MlaFormat) -> bool:
    """Whether the kernel handles these inputs (else callers use the reference)."""
    name = mla_format_name(row_format)
    return (
        name in ("fp8_ds_mla", "bf16")
        and q_latent.shape[-1] == LATENT_DIM
        and q_rope.shape[-1] == ROPE_DIM
        and kv_cache.dim() == 3
        and kv_cache.dtype == torch.uint8
        and kv_cache.stride(2) == 1
        and kv_cache.shape[2] == mla_row_bytes(name, LATENT_DIM, ROPE_DIM)
    )


@triton.jit
def _sparse_mla_wide_kernel(
    q_lat_ptr,
    q_rope_ptr,
    lat_ptr,  # latent view: e4m3 (fp8 rows) or bf16 (bf16 rows)
    scale_ptr,  # fp32 view of the rows (fp8 only; unused for bf16)
    rope_ptr,  # bf16 view of the rows
    idx_ptr,
    out_ptr,
    lse_ptr,
    sm_scale_log2,
    num_heads,
    top_k,
    block_size: tl.constexpr,  # (constexpr: row -> page arithmetic in shifts)
    split_len,
    s_ql_t,
    s_ql_h,
    s_qr_t,
    s_qr_h,
    s_lat_b,
    s_lat_r,
    s_sc_b,
    s_sc_r,
    s_rp_b,
    s_rp_r,
    s_idx_t,
    s_o_t,
    s_o_h,
    s_o_s,
    s_l_t,
    s_l_h,
    s_l_s,
    IS_FP8: tl.constexpr,
    SC_OFF: tl.constexpr,
    RP_OFF: tl.constexpr,
    ALIGNED: tl.constexpr,
    C: tl.constexpr,
    TILE: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One ``[BLOCK_N, 512]`` latent tile per step, used whole by both dots.

    Why: the four-tile kernel issues five small score dots, each waited on before the next,
    and keeps four accumulators; here the scores are one ``K = 512`` dot plus the RoPE dot
    and the values one ``N = 512`` dot, so the tensor cores see long uninterrupted chains.
    fp8 tiles are dequantised once per row (``bf16(k8 * scale)``) for all heads of the block.
    """
    hb = tl.program_id(0)  # fastest: the head blocks of one (token, split) read the same rows
    t = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    hq = heads.to(tl.int64)[:, None]  # q may be head-major (an einsum's output): int64
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q = tl.load(
        q_lat_ptr + t * s_ql_t + hq * s_ql_h + c[None, :],
        mask=hmask[:, None],
        other=0.0,
    ).to(DOT)
    qr = tl.load(
        q_rope_ptr + t * s_qr_t + hq * s_qr_h + r[None, :],
        mask=hmask[:, None],
        other=0.0,
    ).to(DOT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C], tl.float32)

    start = sp * split_len
    end = tl.minimum(start + split_len, top_k)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * s_idx_t + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0)  # int32 division; int64 only for the byte offsets
        blk = (safe // block_size).to(tl.int64)
        off = (safe % block_size).to(tl.int64)
        lat_rows = blk * s_lat_b + off * s_lat_r
        if IS_FP8:
            j = tl.arange(0, C // TILE)
            d = tl.arange(0, TILE)
            k8 = tl.load(
                lat_ptr + lat_rows[:, None, None] + j[None, :, None] * TILE + d[None, None, :],
                mask=valid[:, None, None],
                other=0.0,
            )
            sc_rows = blk * s_sc_b + off * s_sc_r + SC_OFF
            if ALIGNED:
                sc_rows = tl.multiple_of(sc_rows, 4)
            sc = tl.load(scale_ptr + sc_rows[:, None] + j[None, :], mask=valid[:, None], other=0.0)
            kv = tl.reshape(k8.to(tl.float32) * sc[:, :, None], [BLOCK_N, C]).to(DOT)
        else:
            kv = tl.load(
                lat_ptr + lat_rows[:, None] + c[None, :], mask=valid[:, None], other=0.0
            ).to(DOT)
        rp_rows = blk * s_rp_b + off * s_rp_r + RP_OFF
        if ALIGNED:
            rp_rows = tl.multiple_of(rp_rows, 8)
        kr = tl.load(rope_ptr + rp_rows[:, None] + r[None, :], mask=valid[:, None], other=0.0)

        s = tl.dot(qr, tl.trans(kr.to(DOT)), input_precision=PRECISION)
        s = tl.dot(q, tl.trans(kv), s, input_precision=PRECISION)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT), kv, acc, input_precision=PRECISION)

    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + t * s_l_t + sp * s_l_s + heads * s_l_h, lse, mask=hmask)
    o = out_ptr + t * s_o_t + sp * s_o_s + heads[:, None] * s_o_h + c[None, :]
    tl.store(o, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])


#: The compiled kernel of the last launch (benchmarks read its registers and spills).
last_compiled: list = [None]


def num_splits_for(
    num_tokens: int, num_heads: int, top_k: int, cfg: DecodeConfig, device: torch.device
) -> int:
    """Splits over top-k for the (token, head block) programs.

    The kernel's shared memory (q plus the staged rows) allows one program per SM, so the
    splits fill one wave: the most that keep every (token, head block, split) program on an
    SM of its own, at most one per tile. A second wave costs a whole program's time and every
    split writes a 128-head fp32 partial for the combine to read (`bench_sparse_mla.py
    --splits` measured the two rules).
    """
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    programs = max(1, num_tokens * head_blocks)
    tiles = max(1, triton.cdiv(top_k, cfg.block_n))
    return max(1, min(tiles, num_sms(device) // programs))


def decode_operands(q_latent: Tensor, q_rope: Tensor, indices: Tensor) -> tuple[Tensor, ...]:
    """The queries with unit stride on their last dim and the indices as int32 rows (copies
    only where they are not already): what the decode kernels (Triton and Gluon) index."""
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    return q_latent, q_rope, indices


def sparse_mla_decode_triton(
    q_latent: Tensor,
    q_rope: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    scale: float,
    row_format: MlaFormat,
    *,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Same contract as `sparse_mla_decode_reference` (``out [T,H,512]``, ``lse [T,H]`` fp32).

    ``kv_cache`` is ``[num_blocks, block_size, row_bytes]`` uint8 with any strides on the
    first two dims and unit stride on the bytes; ``indices [T, K]`` int32 physical rows,
    ``-1`` masked. ``config`` / ``num_splits`` override the tile shape and split count.
    """
    name = mla_format_name(row_format)
    t, h, c = q_latent.shape
    if q_rope.shape[:2] != (t, h) or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"shapes disagree: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, "
            f"indices {tuple(indices.shape)}"
        )
    if not supports(q_latent, q_rope, kv_cache, name):
        raise ValueError(
            f"Triton sparse MLA needs fp8_ds_mla or bf16 rows of a {LATENT_DIM}+{ROPE_DIM} "
            f"latent with unit byte stride; got {name} kv {tuple(kv_cache.shape)} strides "
            f"{kv_cache.stride()}, q {tuple(q_latent.shape)} / {tuple(q_rope.shape)}"
        )
    device = q_latent.device
    k = indices.shape[1]
    cfg = config or default_config(t, h)
    splits = num_splits or num_splits_for(t, h, k, cfg, device)
    split_len = split_length(k, splits, cfg.block_n)
    q_latent, q_rope, indices = decode_operands(q_latent, q_rope, indices)

    is_fp8 = name == "fp8_ds_mla"
    rope_view = kv_cache.view(torch.bfloat16)
    if is_fp8:
        lat_view = kv_cache.view(torch.float8_e4m3fn)
        scale_view = kv_cache.view(torch.float32)
        sc_off, rp_off = LATENT_DIM // 4, (LATENT_DIM + 4 * (LATENT_DIM // _TILE)) // 2
    else:
        lat_view = rope_view
        scale_view = rope_view  # unused
        sc_off, rp_off = 0, LATENT_DIM

    # The row strides in elements are not multiples of 16 (an fp8 row is 656 bytes), so
    # Triton cannot see that each row's scales and RoPE part are 16-byte aligned; without
    # the hint they load 4 and 2 bytes at a time, and the pipeliner does not stage such loads
    # ahead (the RoPE rows were a synchronous gather every step).
    aligned = kv_cache.stride(0) % 16 == 0 and kv_cache.stride(1) % 16 == 0
    out, lse, o_buf, l_buf, so, sl = split_buffers(t, h, c, splits, q_latent.dtype, device)
    if t == 0:
        return out, lse

    interp = interpreting() or device.type != "cuda"
    dot = dict(DOT=tl.float32 if interp else tl.bfloat16, PRECISION="ieee" if interp else "tf32")
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for lo, hi in grid_slices(t):  # tokens are grid axis 1: at most 65535 per launch
        grid = (triton.cdiv(h, cfg.block_h), hi - lo, splits)
        common = (
            q_latent[lo:hi], q_rope[lo:hi], lat_view, scale_view, rope_view, indices[lo:hi],
            o_buf[lo:hi], l_buf[lo:hi], scale * LOG2E, h, k, kv_cache.shape[1], split_len,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            lat_view.stride(0), lat_view.stride(1), scale_view.stride(0), scale_view.stride(1),
            rope_view.stride(0), rope_view.stride(1), indices.stride(0),
            so[0], so[1], so[2], sl[0], sl[1], sl[2],
        )  # fmt: skip
        last_compiled[0] = _sparse_mla_wide_kernel[grid](
            *common, IS_FP8=is_fp8, SC_OFF=sc_off, RP_OFF=rp_off, ALIGNED=aligned,
            C=LATENT_DIM, TILE=_TILE, R=ROPE_DIM, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            **dot, **launch,
        )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, l_buf, out, lse)
    return out, lse


def decode_bytes(num_tokens: int, num_heads: int, top_k: int, row_format: MlaFormat,
                 q_bytes: int = 2) -> int:  # fmt: skip
    """Fewest HBM bytes of one call: gathered rows + q read + out written (benchmarks)."""
    rows = num_tokens * top_k * mla_row_bytes(row_format, LATENT_DIM, ROPE_DIM)
    q = num_tokens * num_heads * (LATENT_DIM + ROPE_DIM) * q_bytes
    out = num_tokens * num_heads * LATENT_DIM * q_bytes
    return rows + q + out


def decode_flops(num_tokens: int, num_heads: int, top_k: int) -> int:
    """Matrix FLOPs of one call (scores over 576 dims, values over 512)."""
    return 2 * num_tokens * num_heads * top_k * (LATENT_DIM + ROPE_DIM + LATENT_DIM)


__all__ = [
    "DecodeConfig",
    "decode_bytes",
    "decode_flops",
    "default_config",
    "num_splits_for",
    "sparse_mla_decode_triton",
    "supports",
]
