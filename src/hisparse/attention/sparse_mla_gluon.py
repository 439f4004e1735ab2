"""Sparse MLA decode over ``fp8_ds_mla`` rows as a warp-specialised Gluon kernel for Hopper.

Same contract and grid as `sparse_mla_triton` (a program takes 64 heads of one token and one
split of its top-k; an fp32 partial per split when there are several, merged by
`triton_split.combine_splits`) and the same numerics as its default "wide" kernel: each fp8
row is dequantised to bf16 once (``bf16(f32(k8) * scale)``), the scores are one ``K = 512``
dot plus the RoPE dot, the values one ``N = 512`` dot, fp32 accumulation, online softmax in
base 2.

Why Gluon: a program's 64-row steps have three kinds of work (dequantise the rows, the score
dot and softmax, the value dot) that plain Triton runs one after another in every warp. Here
three warp groups each own one and hand tiles over through shared memory and mbarriers:

- `_rows` gathers a tile's rows into registers (issued as soon as it has stored the tile
  before), waits for a free tile of the two-tile ring, dequantises into it, writes the
  tile's score bias (``-inf`` for rows ``-1``) and signals it full;
- `_scores` (the default partition) computes the tile's ``64 x 64`` scores, the online
  softmax, leaves the probabilities and the rescale factor in shared memory for `_values`,
  and accumulates output columns 0-255;
- `_values` rescales and accumulates columns 256-511 from those probabilities.

A tile is free again when both dot groups are done with it. The query (72 KB), the ring
(2 x 72 KB) and the probabilities (8 KB) fill an SM's shared memory: there is no room to stage
raw rows, so `_rows` holds the next tile's rows in registers. The registers are split by
warp group (`WORKER_REGS`). The fp8 values cross `_rows`' loop as int32 words, since a
register per value spilled, and the dequantisation is inline PTX that stays below the
mbarrier wait (LLVM hoisted a plain conversion above it).

Gluon kernels do not run under Triton's CPU interpreter, so CI compiles this one for sm_90
(``tests/test_sparse_mla_gluon.py``: shared memory, spills, wgmma serialisation) and runs the
Triton kernel; ``tests/gpu/test_sparse_mla_gluon_gpu.py`` runs it against the reference and
beside the Triton kernel. `supported` says where it runs; the dispatch takes it there for
every call on 16-byte aligned rows (docs/benchmarks.md §9).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
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
#: Warps of the default partition (`_scores`, the launch's ``num_warps``) and of the two
#: workers (`_values`, `_rows`).
NUM_WARPS = 4
WORKER_WARPS = gl.constexpr([4, 4])
#: Registers a thread: the workers get these and `_scores` what ``MAX_REGS`` over the 12
#: warps leaves (``3 * 168 - 160 - 136 = 208``), the register file's 64K. Fewer for `_rows`
#: spill there, fewer for `_scores` spill its accumulators, and `_values` needs more than 152
#: (ptxas: tests/test_sparse_mla_gluon.py compiles the kernel).
WORKER_REGS = gl.constexpr([160, 136])
MAX_REGS = 168
#: A warp group's half of a program's output, ``[64 heads, 256 columns]`` fp32 (wgmma layout).
HALF_LAYOUT = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
)


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
    BH: gl.constexpr = 64
    mma16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    # [heads, 512] bf16 (q latent) and [heads, 64] (q RoPE) over the default partition's 4 warps
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    sp = gl.program_id(2)

    # -- the token's query, once, in shared memory ----------------------------------------------
    q_smem = _query_to_shared(q_lat_ptr + t * s_ql_t, s_ql_h, hb, num_heads, C, q_layout, mma16)
    qr_smem = _query_to_shared(q_rope_ptr + t * s_qr_t, s_qr_h, hb, num_heads, R, r_layout,
                               mma16)  # fmt: skip

    # -- a ring of two dequantised tiles, the probabilities, one value per head -----------------
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, C], mma16)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], mma16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=min(128, 2 * BN), element_bitwidth=16, rank=2
    )
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], p_layout)
    head_smem = gl.allocate_shared_memory(gl.float32, [BH], plain1)
    # each tile's row mask as a score bias: 0, or -inf for rows -1 and past the split's end
    bias_smem = gl.allocate_shared_memory(gl.float32, [2, BN], plain1)
    # tile b full (rows -> scores), tile b empty (both dot groups -> rows), probabilities
    # ready (scores -> values), probabilities read (values -> scores), 1/l written
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(full.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)
    for j in gl.static_range(3):
        mbarrier.init(sync.index(j), count=1)
    handoff = (sync.index(0), sync.index(1), sync.index(2))  # p ready, p read, 1/l ready

    start = sp * split_len
    end = gl.minimum(start + split_len, top_k)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    idx_row = idx_ptr + t * s_idx_t
    o_row = out_ptr + t * s_o_t + sp * s_o_s
    lse_row = lse_ptr + t * s_l_t + sp * s_l_s
    out = (hb, num_heads, o_row, s_o_h)
    gl.warp_specialize(
        [
            (_scores, (q_smem, qr_smem, kv_smem, kr_smem, bias_smem, p_smem, head_smem, full,
                       empty, handoff, n_tiles, sm_scale_log2, out, lse_row, s_l_h, BN)),
            (_values, (kv_smem, p_smem, head_smem, empty, handoff, n_tiles, out)),
            (_rows, (kv_smem, kr_smem, bias_smem, full, empty, idx_row, start, end, n_tiles,
                     lat_ptr, sc_ptr, rp_ptr, s_kv_b, s_kv_r, block_size, BN)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )  # fmt: skip


@gluon.jit
def _query_to_shared(q_row, s_h, hb, num_heads, width: gl.constexpr, layout: gl.constexpr,
                     smem_layout: gl.constexpr):  # fmt: skip
    """The program's 64 heads of one query part (``width`` columns) as bf16 in shared memory
    (heads past ``num_heads`` zero)."""
    h = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, width, layout=gl.SliceLayout(0, layout))
    q = gl.load(q_row + h.to(gl.int64)[:, None] * s_h + c[None, :], mask=(h < num_heads)[:, None],
                other=0.0)  # fmt: skip
    return gl.allocate_shared_memory(gl.bfloat16, [64, width], smem_layout, q.to(gl.bfloat16))


@gluon.jit
def _scores(q_smem, qr_smem, kv_smem, kr_smem, bias_smem, p_smem, head_smem, full, empty,
            handoff, n_tiles, sm_scale_log2, out, lse_row, s_l_h, BN: gl.constexpr):  # fmt: skip
    """The default partition (one warp group): each tile's scores, the online softmax, the
    probabilities handed to `_values` through shared memory, and output columns 0-255."""
    hb = out[0]
    num_heads = out[1]
    p_ready, p_read, inv_ready = handoff
    BH: gl.constexpr = 64
    HALF: gl.constexpr = 256
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = HALF_LAYOUT
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)
    for i in range(n_tiles):
        b = i % 2
        mbarrier.wait(full.index(b), (i // 2) & 1)
        kv = kv_smem.index(b)
        s_tok = warpgroup_mma(qr_smem, kr_smem.index(b).permute((1, 0)),
                              gl.zeros([BH, BN], gl.float32, layout=s_layout), use_acc=False,
                              is_async=True)  # fmt: skip
        s_tok = warpgroup_mma(q_smem, kv.permute((1, 0)), s_tok, is_async=True)
        bias = bias_smem.index(b).load(gl.SliceLayout(0, s_layout))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = s * sm_scale_log2 + bias[None, :]
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(p_read, (i & 1) ^ 1)  # `_values` is done with the last probabilities
        p_smem.store(p.to(gl.bfloat16))
        head_smem.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready)
        acc = warpgroup_mma(p_smem, kv.slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(b))

    # -- normalise; a head that saw no valid row gets out 0 and lse -inf -----------------------
    has = l_i > 0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    lh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_row + lh * s_l_h, lse, mask=lh < num_heads)
    mbarrier.wait(p_read, (n_tiles & 1) ^ 1)  # `_values` has read the last rescale
    head_smem.store(inv)
    gl.thread_barrier()
    mbarrier.arrive(inv_ready)
    _store_half(acc, gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), out, 0, o_layout)


@gluon.jit
def _values(kv_smem, p_smem, head_smem, empty, handoff, n_tiles, out):
    """A worker warp group: output columns 256-511, from the probabilities `_scores` leaves in
    shared memory (rescaled by the factor beside them) and each tile's upper half."""
    p_ready, p_read, inv_ready = handoff
    BH: gl.constexpr = 64
    HALF: gl.constexpr = 256
    o_layout: gl.constexpr = HALF_LAYOUT
    acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)
    for i in range(n_tiles):
        mbarrier.wait(p_ready, i & 1)
        alpha = head_smem.load(gl.SliceLayout(1, o_layout))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem, kv_smem.index(i % 2).slice(HALF, HALF, dim=1), acc,
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(p_read)
        mbarrier.arrive(empty.index(i % 2))
    mbarrier.wait(inv_ready, 0)
    inv = head_smem.load(gl.SliceLayout(1, o_layout))
    _store_half(acc, inv, out, HALF, o_layout)


@gluon.jit
def _rows(kv_smem, kr_smem, bias_smem, full, empty, idx_row, start, end, n_tiles, lat_ptr,
          sc_ptr, rp_ptr, s_kv_b, s_kv_r, block_size: gl.constexpr, BN: gl.constexpr):  # fmt: skip
    """A worker warp group: gathers each tile's rows into registers, then dequantises them
    (``bf16(k8 * scale)`` per 128-value tile) into the ring's free tile, with the tile's score
    bias. The bottleneck at many tokens: it waits for its own gathers (design.md §17)."""
    SC_OFF: gl.constexpr = 128  # fp32 element of a row's first scale
    RP_OFF: gl.constexpr = 264  # bf16 element of a row's RoPE part
    # one 128-value fp8 tile of each row as int32 words: [rows, 32], 16 bytes a thread;
    # [rows, 64] bf16 RoPE
    lat_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    lr = gl.arange(0, BN, layout=gl.SliceLayout(1, lat_layout))
    ld = gl.arange(0, 32, layout=gl.SliceLayout(0, lat_layout))
    rc = gl.arange(0, 64, layout=gl.SliceLayout(0, r_layout))
    k0, k1, k2, k3, s0, s1, s2, s3, rp, bias = _gather(
        _indices(idx_row, start, end, lr), ld, rc, lat_ptr, sc_ptr, rp_ptr, s_kv_b, s_kv_r,
        block_size, SC_OFF, RP_OFF)  # fmt: skip
    # indices a tile ahead of the rows (the rows' loads would wait on theirs)
    idx_next = _indices(idx_row, start + BN, end, lr)
    for i in range(n_tiles):
        b = i % 2
        mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)
        kv = kv_smem.index(b)
        kr_smem.index(b).store(rp)
        bias_smem.index(b).store(bias)
        kv.slice(0, 128, dim=1).store(_dequantise(k0, s0))
        kv.slice(128, 128, dim=1).store(_dequantise(k1, s1))
        kv.slice(256, 128, dim=1).store(_dequantise(k2, s2))
        kv.slice(384, 128, dim=1).store(_dequantise(k3, s3))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(b))
        # the next tile's rows: in flight while this one is consumed (and while `_rows` waits
        # for a free tile, if the dots are the slower side)
        k0, k1, k2, k3, s0, s1, s2, s3, rp, bias = _gather(
            idx_next, ld, rc, lat_ptr, sc_ptr, rp_ptr, s_kv_b, s_kv_r, block_size, SC_OFF,
            RP_OFF)  # fmt: skip
        idx_next = _indices(idx_row, start + (i + 2) * BN, end, lr)


@gluon.jit
def _gather(idx, ld, rc, lat_ptr, sc_ptr, rp_ptr, s_kv_b, s_kv_r, block_size: gl.constexpr,
            SC_OFF: gl.constexpr, RP_OFF: gl.constexpr):  # fmt: skip
    """Rows ``idx`` (``-1`` reads nothing: zeros) as their four fp8 tiles (int32 words), their
    four scales, their RoPE part and their score bias (``-inf`` for rows ``-1``)."""
    valid = idx >= 0
    safe = gl.where(valid, idx, 0)
    row = (safe // block_size).to(gl.int64) * s_kv_b + (safe % block_size).to(gl.int64) * s_kv_r
    lat = lat_ptr + (row // 4)[:, None] + ld[None, :]
    m2 = valid[:, None]
    k0 = gl.load(lat, mask=m2, other=0)
    k1 = gl.load(lat + 32, mask=m2, other=0)
    k2 = gl.load(lat + 64, mask=m2, other=0)
    k3 = gl.load(lat + 96, mask=m2, other=0)
    sc = sc_ptr + (row // 4 + SC_OFF)
    s0 = gl.load(sc, mask=valid, other=0.0)
    s1 = gl.load(sc + 1, mask=valid, other=0.0)
    s2 = gl.load(sc + 2, mask=valid, other=0.0)
    s3 = gl.load(sc + 3, mask=valid, other=0.0)
    # (the same rows a thread as the latent's layout: no data moves)
    rrow = gl.convert_layout(row, gl.SliceLayout(1, rc.type.layout.parent))
    rvalid = gl.convert_layout(valid, gl.SliceLayout(1, rc.type.layout.parent))
    rp = gl.load(rp_ptr + (rrow[:, None] // 2 + RP_OFF) + rc[None, :], mask=rvalid[:, None],
                 other=0.0)  # fmt: skip
    bias = gl.where(valid, 0.0, float("-inf"))
    return k0, k1, k2, k3, s0, s1, s2, s3, rp, bias


@gluon.jit
def _dequantise(words, scale):
    """``bf16(f32(k8) * scale)`` of the four fp8 values in each int32 word, as the Triton
    kernel rounds it, ``[rows, words] -> [rows, 4 * words]``. The words cross the loop as
    int32 (as fp8 each value would take a register of its own); the PTX is inline and
    volatile because LLVM would hoist a plain conversion above the mbarrier wait before it
    and hold the tile's bf16 values (twice the fp8 bytes) in registers across the wait."""
    words, scale = gl.broadcast(words, scale[:, None])
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 h01, h23;
        .reg .f16 e0, e1, e2, e3;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 h01, lo;
        cvt.rn.f16x2.e4m3x2 h23, hi;
        mov.b32 {e0, e1}, h01;
        mov.b32 {e2, e3}, h23;
        cvt.f32.f16 f0, e0;
        cvt.f32.f16 f1, e1;
        cvt.f32.f16 f2, e2;
        cvt.f32.f16 f3, e3;
        mul.f32 f0, f0, $5;
        mul.f32 f1, f1, $5;
        mul.f32 f2, f2, $5;
        mul.f32 f3, f3, $5;
        cvt.rn.bf16.f32 $0, f0;
        cvt.rn.bf16.f32 $1, f1;
        cvt.rn.bf16.f32 $2, f2;
        cvt.rn.bf16.f32 $3, f3;
        }""",
        "=h,=h,=h,=h,r,r",
        [words, scale],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=False,
        pack=1,
    )
    # (join adds a minor dimension: [.., i, j] is value 2 * i + j of the word)
    v = gl.join(gl.join(v0, v2), gl.join(v1, v3))
    return gl.reshape(v, [v.shape[0], 4 * v.shape[1]])


@gluon.jit
def _store_half(acc, inv, out, col0: gl.constexpr, o_layout: gl.constexpr):
    """``acc * inv`` (``1 / l``) into output columns ``col0 .. col0 + 255`` of the program's
    heads; ``out`` is (head block, heads, the program's output row, its head stride)."""
    hb = out[0]
    num_heads = out[1]
    o_row = out[2]
    s_o_h = out[3]
    oh = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    oc = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
    gl.store(
        o_row + oh.to(gl.int64)[:, None] * s_o_h + oc[None, :],
        (acc * inv[:, None]).to(o_row.dtype.element_ty),
        mask=(oh < num_heads)[:, None],
    )


@gluon.jit
def _indices(idx_row, n0, end, lanes):
    """The token's row indices ``n0 + lanes`` (``-1`` past ``end``), in ``lanes``' layout."""
    offs = n0 + lanes
    return gl.load(idx_row + offs, mask=offs < end, other=-1)


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
            q_latent[lo:hi], q_rope[lo:hi], kv_cache.view(torch.int32),
            kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16), indices[lo:hi],
            o_buf[lo:hi], l_buf[lo:hi],
            scale * LOG2E, h, k, split_len,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
            so[0], so[1], so[2], sl[0], sl[1], sl[2],
            block_size=kv_cache.shape[1], BN=BLOCK_N, num_warps=NUM_WARPS, maxnreg=MAX_REGS,
        )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, l_buf, out, lse)
    return out, lse


__all__ = ["rows_aligned", "sparse_mla_decode_gluon", "supported"]
