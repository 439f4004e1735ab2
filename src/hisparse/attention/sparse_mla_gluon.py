"""Sparse MLA decode over ``fp8_ds_mla`` rows as a Gluon kernel for Hopper (sm_90).

Same contract and grid as `sparse_mla_triton` (a program takes 64 heads of one token and one
split of its top-k; an fp32 partial per split when there are several, merged by
`triton_split.combine_splits`) and the same numerics as its default "wide" kernel: each fp8
row is dequantised to bf16 once (``bf16(k8 * scale)``), the scores are one ``K = 512`` dot
plus the RoPE dot, the values one ``N = 512`` dot, fp32 accumulation, online softmax in
base 2.

Why a second kernel: plain Triton decides where each warp group works. For this loop it
gives the score dot ``[8, 1]`` warps, so both warp groups of a program compute the same
``64 x 64`` score tile. Gluon states the layouts, so here the score dot's warps are
``[4, 2]`` (each group computes the scores of 32 of the step's 64 rows; the softmax's row
maximum and sum cross the two groups through shared memory) and the value dot's too (each
group owns 256 of the 512 output columns, reading the probabilities from shared memory).
Each step's rows are copied one step ahead (``cp.async``) and their indices loaded one step
before that, so that the loads' latency hides behind a step's work.

Measured and not kept (docs/benchmarks.md §9): running the value dot of step ``i`` while the
registers dequantise step ``i + 1`` (the dequantised tile held in registers spilled; into a
second shared buffer it needs 32-row steps), and any dot left in flight across the loop's
back edge: ptxas then copies the in-flight accumulator's registers for the loop and
serialises every wgmma of the kernel (its C7515 note).

Shared memory: the query (72 KB), the dequantised tile (72 KB), the staged raw tile (41 KB)
and the probabilities (8 KB). Gluon kernels do not run under Triton's CPU interpreter, so CI
compiles this one for sm_90 (``tests/test_sparse_mla_gluon.py``) and runs the Triton kernel;
``tests/gpu/test_sparse_mla_gluon_gpu.py`` runs it against the reference and beside the
Triton kernel. `supported` says where it runs; the dispatch takes it from
`MIN_TOKENS` query tokens on (below that the Triton kernel's shorter prologue wins).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from hisparse.attention.sparse_mla_triton import (
    LATENT_DIM,
    LOG2E,
    ROPE_DIM,
    DecodeConfig,
    decode_operands,
    num_splits_for,
)
from hisparse.attention.triton_split import (
    combine_splits,
    grid_slices,
    split_buffers,
    split_length,
)
from hisparse.kv.row_formats import mla_row_bytes

Tensor = torch.Tensor

ROW_BYTES = mla_row_bytes("fp8_ds_mla", LATENT_DIM, ROPE_DIM)
BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8
#: Fewest query tokens the dispatch sends here: below them the Triton kernel's shorter
#: prologue wins (one or two 64-row steps a program; docs/benchmarks.md §9).
MIN_TOKENS = 16


@functools.cache
def supported(device: torch.device) -> bool:
    """A Hopper GPU (sm_90) outside the interpreter: where this kernel compiles and runs."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


@gluon.jit
def _sparse_mla_gluon_kernel(
    q_lat_ptr, q_rope_ptr, lat_ptr, sc_ptr, rp_ptr, idx_ptr, out_ptr, lse_ptr,
    sm_scale_log2, num_heads, top_k, split_len,
    s_ql_t, s_ql_h, s_qr_t, s_qr_h, s_kv_b, s_kv_r, s_idx_t,
    s_o_t, s_o_h, s_o_s, s_l_t, s_l_h, s_l_s,
    block_size: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    C: gl.constexpr = 512
    R: gl.constexpr = 64
    TILE: gl.constexpr = 128
    BH: gl.constexpr = 64
    SC_OFF: gl.constexpr = 128  # fp32 element of a row's first scale
    RP_OFF: gl.constexpr = 264  # bf16 element of a row's RoPE part

    # -- layouts ---------------------------------------------------------------------------
    # scores [heads, rows]: each warp group computes half of the rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    # output [heads, 512]: each warp group owns 256 columns
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    # [rows, 4, 128] fp8 latent: 16 bytes a thread, one row a warp
    lat_layout: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [8, 1, 1], [2, 1, 0])
    sc_layout: gl.constexpr = gl.SliceLayout(2, lat_layout)
    # [rows, 64] bf16 (RoPE) and [heads, 64] bf16 (q RoPE): 16 bytes a thread
    r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    # [heads, 512] bf16 (q latent)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    idx_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, lat_layout))
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    mma16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    sp = gl.program_id(2)

    # -- the token's query, once ---------------------------------------------------------------
    qh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, q_layout))
    qc = gl.arange(0, C, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(
        q_lat_ptr + t * s_ql_t + qh.to(gl.int64)[:, None] * s_ql_h + qc[None, :],
        mask=(qh < num_heads)[:, None],
        other=0.0,
    ).to(gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, C], mma16, q)
    rh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, r_layout))
    rc = gl.arange(0, R, layout=gl.SliceLayout(0, r_layout))
    qr = gl.load(
        q_rope_ptr + t * s_qr_t + rh.to(gl.int64)[:, None] * s_qr_h + rc[None, :],
        mask=(rh < num_heads)[:, None],
        other=0.0,
    ).to(gl.bfloat16)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, R], mma16, qr)

    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, C], mma16)  # dequantised latent
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, R], mma16)  # its RoPE part
    p_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=min(128, 2 * BN), element_bitwidth=16, rank=2
    )
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], p_layout)
    raw_lat = gl.allocate_shared_memory(gl.float8e4nv, [BN, 4, TILE], plain3)
    raw_sc = gl.allocate_shared_memory(gl.float32, [BN, 4], plain2)
    raw_rp = gl.allocate_shared_memory(gl.bfloat16, [BN, R], plain2)

    start = sp * split_len
    end = gl.minimum(start + split_len, top_k)
    n_tiles = gl.cdiv(end - start, BN)

    # element offsets inside a row, per layout
    lr = gl.arange(0, BN, layout=idx_layout)
    lj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, lat_layout)))
    ld = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, lat_layout)))
    lat_cols = (lj * TILE)[None, :, None] + ld[None, None, :]
    sj = gl.arange(0, 4, layout=gl.SliceLayout(0, sc_layout))
    idx_row = idx_ptr + t * s_idx_t

    # -- prologue: step 0's rows dequantised, step 1's in flight -------------------------------
    _issue_tile(_indices(idx_row, start, end, lr), lat_ptr, sc_ptr, rp_ptr, lat_cols, sj, rc,
                raw_lat, raw_sc, raw_rp, s_kv_b, s_kv_r, block_size, SC_OFF, RP_OFF,
                lat_layout, sc_layout, r_layout)  # fmt: skip
    async_copy.wait_group(0)
    gl.thread_barrier()
    _dequantise(raw_lat, raw_sc, raw_rp, kv_smem, kr_smem, lat_layout,
                sc_layout, r_layout)  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()
    _issue_tile(_indices(idx_row, start + BN, end, lr), lat_ptr, sc_ptr, rp_ptr, lat_cols, sj,
                rc, raw_lat, raw_sc, raw_rp, s_kv_b, s_kv_r, block_size, SC_OFF, RP_OFF,
                lat_layout, sc_layout, r_layout)  # fmt: skip

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BH, C], gl.float32, layout=o_layout)
    cols = gl.arange(0, BN, layout=col_layout)
    # index loads one step ahead of their use (their latency hides behind a step's work)
    valid = _indices(idx_row, start, end, cols) >= 0
    idx_next = _indices(idx_row, start + 2 * BN, end, lr)

    # Each dot is waited for in the step that issues it (see the module docstring).
    for i in range(n_tiles):
        n0 = start + i * BN
        s_tok = warpgroup_mma(qr_smem, kr_smem.permute((1, 0)),
                              gl.zeros([BH, BN], gl.float32, layout=s_layout), use_acc=False,
                              is_async=True)  # fmt: skip
        s_tok = warpgroup_mma(q_smem, kv_smem.permute((1, 0)), s_tok, is_async=True)
        valid_next = _indices(idx_row, n0 + BN, end, cols) >= 0
        idx_after = _indices(idx_row, n0 + 3 * BN, end, lr)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        async_copy.wait_group(0)  # step i + 1's rows (copied during step i - 1)
        gl.thread_barrier()
        acc = warpgroup_mma(p_smem, kv_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # both groups' value dots are done with the tile
        _dequantise(raw_lat, raw_sc, raw_rp, kv_smem, kr_smem, lat_layout, sc_layout, r_layout)
        fence_async_shared()
        gl.thread_barrier()  # the staging is read, the tile written
        _issue_tile(idx_next, lat_ptr, sc_ptr, rp_ptr, lat_cols, sj, rc, raw_lat, raw_sc,
                    raw_rp, s_kv_b, s_kv_r, block_size, SC_OFF, RP_OFF, lat_layout, sc_layout,
                    r_layout)  # fmt: skip
        valid = valid_next
        idx_next = idx_after
    async_copy.wait_group(0)

    # -- normalise and store; a head that saw no valid row gets out 0 and lse -inf -------------
    has = l_i > 0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    lh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + t * s_l_t + sp * s_l_s + lh * s_l_h, lse, mask=lh < num_heads)
    oh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
    oc = gl.arange(0, C, layout=gl.SliceLayout(0, o_layout))
    o = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(
        out_ptr + t * s_o_t + sp * s_o_s + oh.to(gl.int64)[:, None] * s_o_h + oc[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(oh < num_heads)[:, None],
    )


@gluon.jit
def _indices(idx_row, n0, end, lanes):
    """The token's row indices ``n0 + lanes`` (``-1`` past ``end``), in ``lanes``' layout."""
    offs = n0 + lanes
    return gl.load(idx_row + offs, mask=offs < end, other=-1)


@gluon.jit
def _issue_tile(
    idx,
    lat_ptr,
    sc_ptr,
    rp_ptr,
    lat_cols,
    sj,
    rc,
    raw_lat,
    raw_sc,
    raw_rp,
    s_kv_b,
    s_kv_r,
    block_size: gl.constexpr,
    SC_OFF: gl.constexpr,
    RP_OFF: gl.constexpr,
    lat_layout: gl.constexpr,
    sc_layout: gl.constexpr,
    r_layout: gl.constexpr,
):
    """Start copying the rows ``idx`` into the staging buffers (rows ``-1`` read nothing:
    zeros), as one commit group."""
    valid = idx >= 0
    safe = gl.where(valid, idx, 0)
    row = (safe // block_size).to(gl.int64) * s_kv_b + (safe % block_size).to(gl.int64) * s_kv_r
    lat = lat_ptr + row[:, None, None] + lat_cols
    async_copy.async_copy_global_to_shared(raw_lat, lat, mask=valid[:, None, None])
    row_s = gl.convert_layout(row, gl.SliceLayout(1, sc_layout))
    valid_s = gl.convert_layout(valid, gl.SliceLayout(1, sc_layout))
    sc = sc_ptr + (row_s[:, None] // 4 + SC_OFF) + sj[None, :]
    async_copy.async_copy_global_to_shared(raw_sc, sc, mask=valid_s[:, None])
    row_r = gl.convert_layout(row, gl.SliceLayout(1, r_layout))
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, r_layout))
    rp = rp_ptr + (row_r[:, None] // 2 + RP_OFF) + rc[None, :]
    async_copy.async_copy_global_to_shared(raw_rp, rp, mask=valid_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _dequantise(raw_lat, raw_sc, raw_rp, kv_smem, kr_smem, lat_layout: gl.constexpr,
                sc_layout: gl.constexpr, r_layout: gl.constexpr):  # fmt: skip
    """The staged rows as bf16 (``bf16(k8 * scale)`` per 128-value tile) into the tile the
    dots read, and their RoPE part as it is."""
    k8 = raw_lat.load(lat_layout)
    sc = raw_sc.load(sc_layout)
    kv = gl.reshape((k8.to(gl.float32) * sc[:, :, None]).to(gl.bfloat16), [k8.shape[0], 512])
    kv_smem.store(kv)
    kr_smem.store(raw_rp.load(r_layout))


def rows_aligned(kv_cache: Tensor) -> bool:
    """Whether every row of ``kv_cache`` starts 16-byte aligned (the kernel copies 16 bytes at
    a time)."""
    return (
        kv_cache.stride(2) == 1
        and kv_cache.stride(0) % 16 == 0
        and kv_cache.stride(1) % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
    )


def sparse_mla_decode_gluon(
    q_latent: Tensor,
    q_rope: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`sparse_mla_decode_reference`'s contract for ``fp8_ds_mla`` rows on sm_90.

    ``kv_cache`` ``[num_blocks, block_size, 656]`` uint8 with 16-byte aligned row and block
    strides; ``indices [T, K]`` int32 physical rows (``-1`` masked)."""
    t, h, c = q_latent.shape
    if c != LATENT_DIM or q_rope.shape != (t, h, ROPE_DIM) or kv_cache.shape[2] != ROW_BYTES:
        raise ValueError(
            f"Gluon sparse MLA needs fp8_ds_mla rows and {LATENT_DIM}+{ROPE_DIM} queries; got "
            f"q {tuple(q_latent.shape)} / {tuple(q_rope.shape)}, kv {tuple(kv_cache.shape)}"
        )
    if not rows_aligned(kv_cache):
        raise ValueError(
            f"kv_cache strides {kv_cache.stride()} at address {kv_cache.data_ptr():#x}: its rows "
            "must start 16-byte aligned (the Triton kernel takes any rows)"
        )
    device = q_latent.device
    k = indices.shape[1]
    splits = num_splits or num_splits_for(t, h, k, DecodeConfig(), device)
    split_len = split_length(k, splits, BLOCK_N)
    q_latent, q_rope, indices = decode_operands(q_latent, q_rope, indices)
    out, lse, o_buf, l_buf, so, sl = split_buffers(t, h, c, splits, q_latent.dtype, device)
    if t == 0:
        return out, lse
    for lo, hi in grid_slices(t):
        grid = (triton.cdiv(h, BLOCK_H), hi - lo, splits)
        _sparse_mla_gluon_kernel[grid](
            q_latent[lo:hi], q_rope[lo:hi], kv_cache.view(torch.float8_e4m3fn),
            kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16), indices[lo:hi],
            o_buf[lo:hi], l_buf[lo:hi],
            scale * LOG2E, h, k, split_len,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
            so[0], so[1], so[2], sl[0], sl[1], sl[2],
            block_size=kv_cache.shape[1], BN=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, l_buf, out, lse)
    return out, lse


__all__ = ["rows_aligned", "sparse_mla_decode_gluon", "supported"]
