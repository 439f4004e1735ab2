"""The lightning indexer's score kernel for fp8 pages as a Gluon kernel for Hopper (TMA ring).

Same contract, grid and numerics as `indexer_triton._indexer_scores_kernel` on page tiles:
program ``(token, chunk)`` holds the token's ``[H, 128]`` query (f16, its dims in
`indexer_triton`'s reordered order) in shared memory and walks its chunk in 64-key tiles, each
one page run: a ``[64, 128] x [128, H]`` f16 wgmma with the keys as the register operand,
ReLU, the weighted head sum, times the key scale; ``-inf`` at and past the causal limit.
Given the top-k's `topk_floor.GroupMaxima` (decode batches that take its floor), it also
writes each 16 keys' largest score and counts its first key byte, so that the select skips
the launch that would read every score again to find them.

Why a second kernel: the Triton one keeps at most two key tiles in flight per program, with
the page arithmetic and the block-table read between its loads, and streams the keys well
short of the copy rate. Here the tensor memory accelerator copies each tile (one 3-D box of
the page's key rows, one box of its scales) into a ring of `STAGES` tiles that one thread
refills as soon as the warps have read a slot, so the loads never wait on the block table or
on the math; the block-table entries a refill needs are loaded two tiles ahead. The products,
the wgmma instructions that sum them and the reductions after are the Triton kernel's, so the
scores are the same bit for bit (``tests/gpu/test_indexer_gpu.py`` checks).

Gluon kernels do not run under Triton's CPU interpreter: CI compiles this one for sm_90
(``tests/test_indexer_gluon.py``) and ``tests/gpu/test_indexer_gpu.py`` runs it against the
reference. `usable` says where the dispatch in `indexer_triton` takes it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from hisparse import envs
from hisparse.attention.sparse_mla_gluon import supported
from hisparse.attention.topk_floor import GroupMaxima
from hisparse.kv.row_formats import IndexerCacheFormat

Tensor = torch.Tensor

HEAD_DIM = 128
BLOCK_N = 64
NUM_WARPS = 4
#: Tiles in a program's ring, the programs an SM holds (shared memory: the f16 query plus
#: ``STAGES`` x (8 KB keys + 256 B scales) a program; registers), and the register cap a
#: thread that lets them (``None``: the compiler's choice). Measured: more programs an SM
#: beat a deeper ring (docs/benchmarks.md §10).
STAGES = 3
PROGRAMS_PER_SM = 4
MAX_REGS: int | None = None
#: Fewest 64-key tiles a program for this kernel: shorter chunks (one request's 128K
#: context, a short prefill) are dominated by a program's fixed cost, where the Triton
#: kernel is ahead.
MIN_TILES = 8
#: Fewest keys (tokens x score columns) of an eager call for this kernel: a launch costs
#: more host time than the Triton kernel's (its TMA descriptors), which a smaller call's GPU
#: time does not hide. Inside a CUDA graph capture the host time is paid once: any size.
EAGER_MIN_KEYS = 1 << 21

#: Keys ``[64, 128]`` fp8 as each thread holds them after the 16-byte shared-memory loads: a
#: thread's 32 bytes of a row are the dims it feeds the f16 wgmma once reordered
#: (`indexer_triton._k_order`), in rows ``16 w + l / 4`` and ``+ 8`` (warp ``w``, lane ``l``),
#: as the wgmma register operand has them, so the reorder moves no data.
KEY_LAYOUT = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[BLOCK_N, HEAD_DIM],
    )
)


def usable(
    q: Tensor, q_scale: Tensor | None, pages: Tensor, fmt: IndexerCacheFormat, page_tiles: bool
) -> bool:
    """fp8 pages on sm_90 that this kernel takes: 128 dims, at most 128 heads, page tiles, and
    a page layout a TMA descriptor can address (16-byte aligned base and stride).
    ``HISPARSE_INDEXER_KERNEL``: ``auto`` (the default) takes it there, ``triton`` never."""
    return (
        envs.value("HISPARSE_INDEXER_KERNEL") == "auto"
        and fmt.kind == "fp8"
        and page_tiles
        and fmt.head_dim == HEAD_DIM
        and q.shape[1] <= 128
        and q_scale is not None
        and pages.is_cuda
        and pages.stride(0) % 16 == 0
        and pages.data_ptr() % 16 == 0
        and (pages.shape[1] // fmt.row_bytes) % BLOCK_N == 0
        and supported(pages.device)
    )


@gluon.jit
def _indexer_scores_gluon_kernel(
    key_desc, scale_desc, q_ptr, qs_ptr, w_ptr, table_ptr, req_ptr, pos_ptr, out_ptr,
    gmax_ptr, hist_ptr, softmax_scale, num_heads, num_cols, chunk,
    s_q_t, s_q_h, s_qs_t, s_qs_h, s_w_t, s_w_h, s_tab_r, s_out_t, s_g_t, s_h_t,
    block_size: gl.constexpr, sc_off: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr,
    GROUP: gl.constexpr,
):  # fmt: skip
    D: gl.constexpr = 128
    BN: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    # a slot's [1, BN] scales (no swizzle: plain order) read as [BN]
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    t = gl.program_id(0).to(gl.int64)
    start = gl.program_id(1) * chunk
    req = gl.load(req_ptr + t)
    limit = gl.where(req >= 0, gl.load(pos_ptr + t) + 1, 0).to(gl.int32)
    stop = gl.minimum(start + chunk, num_cols)
    end = gl.maximum(gl.minimum(stop, limit), start)
    n_tiles = gl.cdiv(end - start, BN)
    row = out_ptr + t * s_out_t
    table_row = table_ptr + gl.maximum(req, 0).to(gl.int64) * s_tab_r

    # -- the ring, its barriers, and the first STAGES tiles in flight ------------------------
    keys_smem = gl.allocate_shared_memory(key_desc.dtype, [STAGES, 1, BN, D], key_desc.layout)
    sc_smem = gl.allocate_shared_memory(scale_desc.dtype, [STAGES, 1, BN], scale_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(full.index(k), count=1)
    fence_async_shared()
    nbytes: gl.constexpr = key_desc.block_type.nbytes + scale_desc.block_type.nbytes
    # block-table entries of tiles 0 .. STAGES + 1 (the loop keeps loading two ahead)
    for k in gl.static_range(STAGES):
        blk = gl.load(table_row + (start + k * BN) // block_size, mask=k < n_tiles, other=0)
        _issue(key_desc, scale_desc, keys_smem, sc_smem, full, k, blk, start + k * BN,
               block_size, sc_off, nbytes, k < n_tiles)  # fmt: skip
    nb0 = gl.load(table_row + (start + STAGES * BN) // block_size, mask=n_tiles > STAGES,
                  other=0)  # fmt: skip
    nb1 = gl.load(table_row + (start + (STAGES + 1) * BN) // block_size,
                  mask=n_tiles > STAGES + 1, other=0)  # fmt: skip

    # -- the token's query (dims reordered as the keys' registers hold them) and weights -----
    heads = gl.arange(0, HP, layout=gl.SliceLayout(1, q_layout))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    hmask = heads < num_heads
    q = gl.load(q_ptr + t * s_q_t + heads.to(gl.int64)[:, None] * s_q_h + dq[None, :],
                mask=hmask[:, None], other=0.0)  # fmt: skip
    q = _k_order(q.to(gl.float16), D)
    q_smem = gl.allocate_shared_memory(
        gl.float16,
        [HP, D],
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16),
        q,
    )
    wh = gl.arange(0, HP, layout=gl.SliceLayout(0, mma))
    wmask = wh < num_heads
    w = gl.load(w_ptr + t * s_w_t + wh * s_w_h, mask=wmask, other=0.0)
    w = w * gl.load(qs_ptr + t * s_qs_t + wh * s_qs_h, mask=wmask, other=0.0) * softmax_scale
    fence_async_shared()
    gl.thread_barrier()

    nr = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        keys = keys_smem.index(s).reshape([BN, D]).load(KEY_LAYOUT)
        scale = sc_smem.index(s)._reinterpret(gl.float32, [BN], flat).load(gl.SliceLayout(1, mma))
        gl.thread_barrier()  # every warp has read slot s: refill it
        j = i + STAGES
        _issue(key_desc, scale_desc, keys_smem, sc_smem, full, s, nb0, start + j * BN,
               block_size, sc_off, nbytes, j < n_tiles)  # fmt: skip
        nb0 = nb1
        n2 = start + (j + 2) * BN
        nb1 = gl.load(table_row + n2 // block_size, mask=j + 2 < n_tiles, other=0)

        a = gl.convert_layout(_k_order(keys.to(gl.float16), D), a_layout)
        logits = warpgroup_mma(a, q_smem.permute((1, 0)), gl.zeros([BN, HP], gl.float32, mma),
                               use_acc=False)  # fmt: skip
        score = gl.sum(gl.maximum(logits, 0.0) * w[None, :], axis=1) * scale
        pos = start + i * BN + nr
        score = gl.where(pos < end, score, float("-inf"))
        gl.store(row + pos, score, mask=pos < stop)
        if GROUP > 0:
            _group_maxima(score, gmax_ptr + t * s_g_t, hist_ptr + t * s_h_t, start + i * BN,
                          stop, BN, GROUP)  # fmt: skip

    # tiles wholly past the causal limit: -inf without reading anything
    nv = gl.arange(0, BN, layout=vec)
    for n0 in range(start + n_tiles * BN, stop, BN):
        pos = n0 + nv
        gl.store(row + pos, gl.full([BN], float("-inf"), gl.float32, vec), mask=pos < stop)
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(k))


@gluon.jit
def _group_maxima(score, gmax_row, hist_row, n0, stop, BN: gl.constexpr, GROUP: gl.constexpr):
    """The tile's largest finite score of each ``GROUP`` keys (positions ``n0 ..``), in
    `topk_triton`'s signed key order (``-0.0`` as ``0.0``; ``INT32_MIN`` for none), into
    ``gmax_row``, and one count each in ``hist_row`` at the first byte of its key. A group is
    one warp's rows of the tile: its maximum is a shuffle reduction, stored and counted by
    one lane (bench_indexer.py --maxima: cheaper than one histogram a program at its end)."""
    x = gl.where(score == 0.0, 0.0, score)
    bits = x.to(gl.int32, bitcast=True)
    v = gl.where(x > float("-inf"), bits ^ ((bits >> 31) & 0x7FFFFFFF), -(2**31))  # NaN: none
    m = gl.max(gl.reshape(v, [BN // GROUP, GROUP]), axis=1)
    g = n0 // GROUP + gl.arange(0, BN // GROUP, layout=m.type.layout)
    keep = g * GROUP < stop
    gl.store(gmax_row + g, m, mask=keep)
    byte = ((m ^ -(2**31)) >> 24) & 255
    ones = gl.full(m.shape, 1, gl.int32, layout=m.type.layout)
    gl.atomic_add(hist_row + byte, ones, mask=keep & (m > -(2**31)), sem="relaxed")


@gluon.jit
def _issue(key_desc, scale_desc, keys_smem, sc_smem, full, s, blk, n0, block_size: gl.constexpr,
           sc_off: gl.constexpr, nbytes: gl.constexpr, pred):  # fmt: skip
    """Copy the 64-key tile at position ``n0`` (page ``blk``) and its scales into slot ``s``."""
    off = n0 % block_size
    bar = full.index(s)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(key_desc, [blk, off, 0], bar, keys_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(scale_desc, [blk, sc_off + off], bar, sc_smem.index(s),
                                    pred=pred)  # fmt: skip


@gluon.jit
def _k_order(x, D: gl.constexpr):
    """`indexer_triton._k_order`: ``x [R, D]``'s columns reordered so that the dims a thread
    feeds the f16 wgmma are ``D / 4`` contiguous bytes of its row."""
    r: gl.constexpr = x.shape[0]
    return gl.reshape(gl.permute(gl.reshape(x, [r, 4, D // 16, 2, 2]), [0, 2, 3, 1, 4]), [r, D])


def descriptors(pages: Tensor, fmt: IndexerCacheFormat) -> tuple:
    """TMA descriptors of the pages' keys (``[blocks, block_size, 128]`` e4m3, a 64-row box,
    128-byte swizzle) and scales (``[blocks, page words]`` fp32, a 64-scale box). Kept on the
    pages tensor (a model passes the same one every step) while its address and shape hold:
    building them costs host time on every eager call."""
    key = (pages.data_ptr(), tuple(pages.shape), tuple(pages.stride()), fmt)
    cached = getattr(pages, "_hisparse_tma", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    made = _descriptors(pages, fmt)
    pages._hisparse_tma = (key, made)  # type: ignore[attr-defined]
    return made


def _descriptors(pages: Tensor, fmt: IndexerCacheFormat) -> tuple:
    nb = pages.shape[0]
    bs = pages.shape[1] // fmt.row_bytes
    keys = pages.view(torch.float8_e4m3fn).as_strided(
        (nb, bs, HEAD_DIM), (pages.stride(0), HEAD_DIM, 1)
    )
    words = pages.view(torch.float32)
    key_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    sc_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (
        TensorDescriptor.from_tensor(keys, [1, BLOCK_N, HEAD_DIM], key_layout),
        TensorDescriptor.from_tensor(words, [1, BLOCK_N], sc_layout),
    )


def launch(
    q: Tensor, qs: Tensor, weights: Tensor, pages: Tensor, fmt: IndexerCacheFormat,
    block_table: Tensor, req_index: Tensor, positions: Tensor, out: Tensor,
    softmax_scale: float, chunk: int, maxima: GroupMaxima | None = None,
):  # fmt: skip
    """Fill ``out [T, S]`` (`indexer_triton.indexer_scores_paged_triton` has checked and
    prepared the operands: ``qs`` fp32 ``[T, H]``, weights fp32, an int32 block table) with
    ``chunk`` keys a program, and ``maxima`` (the top-k's floor, `topk_floor.group_maxima`)
    when given; returns the compiled kernel."""
    t, h, _ = q.shape
    bs = pages.shape[1] // fmt.row_bytes
    key_desc, scale_desc = descriptors(pages, fmt)
    grid = (t, triton.cdiv(out.shape[1], chunk))
    group = 0
    gmax = hist = out  # (not read without maxima)
    if maxima is not None:
        if chunk % maxima.group or BLOCK_N % maxima.group:
            raise ValueError(f"chunk {chunk} splits groups of {maxima.group} keys")
        group, gmax, hist = maxima.group, maxima.gmax, maxima.hist[:, 4]
        maxima.filled = True
    return _indexer_scores_gluon_kernel[grid](
        key_desc, scale_desc, q, qs, weights, block_table, req_index, positions, out, gmax,
        hist, softmax_scale, h, out.shape[1], chunk,
        q.stride(0), q.stride(1), qs.stride(0), qs.stride(1), weights.stride(0),
        weights.stride(1), block_table.stride(0), out.stride(0), gmax.stride(0), hist.stride(0),
        block_size=bs, sc_off=bs * HEAD_DIM // 4, HP=max(32, triton.next_power_of_2(h)),
        STAGES=STAGES, GROUP=group, num_warps=NUM_WARPS,
        **({} if MAX_REGS is None else {"maxnreg": MAX_REGS}),
    )  # fmt: skip


__all__ = ["PROGRAMS_PER_SM", "launch", "usable"]
