"""The data plane's row copies as Triton kernels (docs/design.md §6); `reference` is the oracle.

`gather_compact` (a layer's swap-ins), `gather_compact_group` (an index group's swap-ins, one
read per token span), `gather_plan` (row-to-row copies: host mirror, prefill staging, warm
start) and `invalidate_written_slots` (drops hot copies of rows a step rewrites; like
`gather_plan`, one pass over written rows). Same signatures as the reference, bit-identical
results; no host sync and fixed grids, so a decode step that calls them can be captured in a
CUDA graph.

The gathers copy whole rows as int32x4 (16-byte) accesses, reading the pinned host pool
directly: Triton's launcher turns a pinned or ``cudaHostRegister``-ed CPU tensor's address
into its device (UVA) address with ``cuPointerGetAttribute``, so a pinned CPU tensor can be
passed as is (an unpinned one is refused with "cannot be accessed from Triton"). A persistent
grid walks each request's sorted swap list in runs of consecutive entries, so one program
reads neighbouring host rows together."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.runtime.ops.triton_common import next_pow2

Tensor = torch.Tensor


def _words(view: Tensor) -> tuple[Tensor, int, int, int]:
    """A paged uint8 view as int32 words: (tensor, block stride, row stride, row words)."""
    if view.dtype != torch.uint8 or view.dim() != 3 or view.stride(2) != 1:
        raise ValueError(
            f"expected a [blocks, block_size, row_bytes] uint8 view with unit byte stride, got "
            f"dtype={view.dtype}, shape={tuple(view.shape)}, strides={view.stride()}"
        )
    rb = view.shape[2]
    if rb % 16 or view.stride(0) % 16 or view.stride(1) % 16 or view.data_ptr() % 16:
        raise ValueError(
            f"16-byte row copies need row bytes, strides and base aligned to 16 B; got row "
            f"{rb} B, strides {view.stride()[:2]}, base offset {view.data_ptr() % 16}"
        )
    w = view.view(torch.int32)
    return w, w.stride(0), w.stride(1), rb // 4


def _copy_tile_shape(row_words: int) -> tuple[int, int, int]:
    """(rows per program step, padded row words, warps): ~16 KB moved per step."""
    rwp = next_pow2(row_words)
    t = max(1, min(64, 4096 // rwp))
    return t, rwp, 4


def _num_programs(device: torch.device, work: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(work, 4 * sms))
    return max(1, min(work, 4))


@triton.jit
def _gather_compact_kernel(
    host_ptr, h_sb, h_sr,
    dev_ptr, d_sb, d_sr,
    src_ptr, s_sq, s_sh,
    dst_ptr, t_sq, t_sh,
    cnt_ptr, s_c, Q, bs, G,
    RW: tl.constexpr, RWP: tl.constexpr, T: tl.constexpr, QP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    qs = tl.arange(0, QP)
    cnt = tl.load(cnt_ptr + qs * s_c, mask=qs < Q, other=0).to(tl.int32)
    cnt = tl.maximum(cnt, 0)
    chunks = (cnt + T - 1) // T
    incl = tl.cumsum(chunks, 0)
    total = tl.sum(chunks, 0)
    ti = tl.arange(0, T)
    w = tl.arange(0, RWP)[None, :]
    wm = w < RW
    for item in range(pid, total, G):
        q = tl.sum((incl <= item).to(tl.int32), 0)
        sel = qs == q
        first = tl.sum(tl.where(sel, incl - chunks, 0), 0)
        n_q = tl.sum(tl.where(sel, cnt, 0), 0)
        j = (item - first) * T + ti
        jm = j < n_q
        q64 = q.to(tl.int64)
        sr = tl.load(src_ptr + q64 * s_sq + j * s_sh, mask=jm, other=0).to(tl.int64)
        dr = tl.load(dst_ptr + q64 * t_sq + j * t_sh, mask=jm, other=0).to(tl.int64)
        so = tl.multiple_of((sr // bs) * h_sb + (sr % bs) * h_sr, 4)
        do = tl.multiple_of((dr // bs) * d_sb + (dr % bs) * d_sr, 4)
        m = jm[:, None] & wm
        v = tl.load(host_ptr + so[:, None] + w, mask=m)
        tl.store(dev_ptr + do[:, None] + w, v, mask=m)


def gather_compact(
    host: Tensor, device: Tensor, swap_src: Tensor, swap_dst: Tensor, swap_count: Tensor
) -> None:
    """Triton `reference.gather_compact`: each request's first ``swap_count[q]`` listed rows.

    ``host`` may be a pinned CPU view (read zero-copy over PCIe) or a GPU view.
    """
    Q, H = swap_src.shape
    if Q == 0 or H == 0:
        return
    hw, h_sb, h_sr, rw = _words(host)
    dw, d_sb, d_sr, rw2 = _words(device)
    if rw != rw2:
        raise ValueError(f"row sizes differ: host {4 * rw} B, device {4 * rw2} B")
    t, rwp, nw = _copy_tile_shape(rw)
    g = _num_programs(device.device, Q * triton.cdiv(H, t))
    _gather_compact_kernel[(g,)](
        hw, h_sb, h_sr, dw, d_sb, d_sr,
        swap_src, swap_src.stride(0), swap_src.stride(1),
        swap_dst, swap_dst.stride(0), swap_dst.stride(1),
        swap_count, swap_count.stride(0), Q, host.shape[1], g,
        RW=rw, RWP=rwp, T=t, QP=next_pow2(Q), num_warps=nw,
    )  # fmt: skip


@triton.jit
def _gather_group_kernel(
    host_ptr, h_sb, h_sr,
    dev_ptr, d_sb, d_sr, delta_ptr,
    src_ptr, s_sq, s_sh,
    dst_ptr, t_sq, t_sh,
    cnt_ptr, s_c, Q, bs, NPROG,
    C: tl.constexpr, CPR: tl.constexpr, T: tl.constexpr, F: tl.constexpr, QP: tl.constexpr,
):  # fmt: skip
    """Each step moves T entries' whole spans as F lanes of one 16-byte chunk each.

    Lane ``f`` is chunk ``f % C`` of entry ``f // C``; a span has ``C`` chunks and a row
    ``CPR``, so the chunk belongs to layer ``(f % C) // CPR``, whose rows sit ``delta[layer]``
    words from the base device view. Flat lanes waste no lanes on padding rows to a power of 2.
    """
    pid = tl.program_id(0)
    qs = tl.arange(0, QP)
    cnt = tl.load(cnt_ptr + qs * s_c, mask=qs < Q, other=0).to(tl.int32)
    cnt = tl.maximum(cnt, 0)
    chunks = (cnt + T - 1) // T
    incl = tl.cumsum(chunks, 0)
    total = tl.sum(chunks, 0)
    f = tl.arange(0, F)
    e = f // C
    c = f % C
    fm = e < T
    layer = c // CPR
    delta = tl.load(delta_ptr + layer, mask=fm, other=0)
    dcol = delta + (c % CPR) * 4
    scol = c * 4
    k = tl.arange(0, 4)[None, :]
    for item in range(pid, total, NPROG):
        q = tl.sum((incl <= item).to(tl.int32), 0)
        sel = qs == q
        first = tl.sum(tl.where(sel, incl - chunks, 0), 0)
        n_q = tl.sum(tl.where(sel, cnt, 0), 0)
        j = (item - first) * T + e
        jm = fm & (j < n_q)
        q64 = q.to(tl.int64)
        sr = tl.load(src_ptr + q64 * s_sq + j * s_sh, mask=jm, other=0).to(tl.int64)
        dr = tl.load(dst_ptr + q64 * t_sq + j * t_sh, mask=jm, other=0).to(tl.int64)
        so = tl.multiple_of((sr // bs) * h_sb + (sr % bs) * h_sr + scol, 4)
        do = tl.multiple_of((dr // bs) * d_sb + (dr % bs) * d_sr + dcol, 4)
        m = jm[:, None]
        v = tl.load(host_ptr + so[:, None] + k, mask=m)
        tl.store(dev_ptr + do[:, None] + k, v, mask=m)


#: Word offsets of each layer's view from the group's base view, one small device tensor per
#: (device, offsets): built on the first call (outside graph capture, like the JIT compile),
#: then reused, so later calls upload nothing and can be captured.
_group_deltas: dict[tuple[str, tuple[int, ...]], Tensor] = {}


def _group_delta_tensor(device: torch.device, deltas: tuple[int, ...]) -> Tensor:
    key = (str(device), deltas)
    t = _group_deltas.get(key)
    if t is None:
        t = torch.tensor(deltas, dtype=torch.int64, device=device)
        _group_deltas[key] = t
    return t


def group_tile(span_chunks: int) -> tuple[int, int]:
    """(lanes per step, warps): ~16 KB per program step, like the per-layer gather."""
    return max(1024, next_pow2(span_chunks)), 4


def gather_compact_group(
    host_span: Tensor,
    devices: list[Tensor],
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
    *,
    tile: tuple[int, int] | None = None,
) -> None:
    """Triton `reference.gather_compact_group`: one contiguous read per token for G layers.

    Reads each listed token's ``G * row_bytes`` span once (token-major host layout: the span
    length is what sets PCIe bandwidth, docs/design.md §10) and stores its 16-byte chunks into the
    ``G`` device views. The device views must share one storage (they are pages of one GPU
    pool) with equal shapes and strides; the kernel addresses them from the lowest one.
    ``tile`` (keyword only, benchmarks) overrides `group_tile`.
    """
    G = len(devices)
    Q, H = swap_src.shape
    if G == 0 or Q == 0 or H == 0:
        return
    hw, h_sb, h_sr, span_words = _words(host_span)
    rb = devices[0].shape[2]
    if span_words * 4 != G * rb:
        raise ValueError(
            f"host span holds {4 * span_words} B per token, expected {G} layers x {rb} B"
        )
    d0 = devices[0]
    storage = d0.untyped_storage().data_ptr()
    for d in devices:
        if d.shape != d0.shape or d.stride() != d0.stride() or d.device != d0.device:
            raise ValueError("the group's device views must have equal shapes and strides")
        if d.untyped_storage().data_ptr() != storage:
            raise ValueError("the group's device views must share one storage (one GPU pool)")
        _words(d)  # alignment checks: deltas are then multiples of 16 B
    base = min(devices, key=lambda d: d.data_ptr())
    dw, d_sb, d_sr, rw = _words(base)
    deltas = tuple((d.data_ptr() - base.data_ptr()) // 4 for d in devices)
    delta_t = _group_delta_tensor(base.device, deltas)
    chunks, cpr = span_words // 4, rw // 4
    f, nw = tile if tile is not None else group_tile(chunks)
    t = f // chunks
    if t < 1:
        raise ValueError(f"tile of {f} lanes is smaller than one span ({chunks} chunks)")
    g = _num_programs(base.device, Q * triton.cdiv(H, t))
    _gather_group_kernel[(g,)](
        hw, h_sb, h_sr, dw, d_sb, d_sr, delta_t,
        swap_src, swap_src.stride(0), swap_src.stride(1),
        swap_dst, swap_dst.stride(0), swap_dst.stride(1),
        swap_count, swap_count.stride(0), Q, host_span.shape[1], g,
        C=chunks, CPR=cpr, T=t, F=f, QP=next_pow2(Q), num_warps=nw,
    )  # fmt: skip


@triton.jit
def _gather_plan_kernel(
    src_ptr, s_sb, s_sr,
    dst_ptr, d_sb, d_sr,
    srow_ptr, drow_ptr, mask_ptr, n, bs_s, bs_d, G,
    RW: tl.constexpr, RWP: tl.constexpr, T: tl.constexpr, HAS_MASK: tl.constexpr,
    SRC_IS_INDEX: tl.constexpr = False,
):  # fmt: skip
    """Row copies; ``SRC_IS_INDEX``: row ``j`` of the source is item ``j`` (`scatter_rows`:
    no source row list)."""
    pid = tl.program_id(0)
    ti = tl.arange(0, T)
    w = tl.arange(0, RWP)[None, :]
    wm = w < RW
    n_items = (n + T - 1) // T
    for item in range(pid, n_items, G):
        j = tl.cast(item, tl.int64) * T + ti
        jm = j < n
        if HAS_MASK:
            live = jm & (tl.load(mask_ptr + j, mask=jm, other=0) != 0)
            sr = tl.load(srow_ptr + j, mask=live, other=0).to(tl.int64)
            dr = tl.load(drow_ptr + j, mask=live, other=0).to(tl.int64)
        else:  # both rows valid
            if SRC_IS_INDEX:
                sr = tl.where(jm, j, -1)
            else:
                sr = tl.load(srow_ptr + j, mask=jm, other=-1).to(tl.int64)
            dr = tl.load(drow_ptr + j, mask=jm, other=-1).to(tl.int64)
            live = (sr >= 0) & (dr >= 0)
        so = tl.multiple_of((sr // bs_s) * s_sb + (sr % bs_s) * s_sr, 4)
        do = tl.multiple_of((dr // bs_d) * d_sb + (dr % bs_d) * d_sr, 4)
        m = live[:, None] & wm
        v = tl.load(src_ptr + so[:, None] + w, mask=m)
        tl.store(dst_ptr + do[:, None] + w, v, mask=m)


def gather_plan(
    src: Tensor, dst: Tensor, src_rows: Tensor, dst_rows: Tensor, mask: Tensor | None
) -> None:
    """Triton `reference.gather_plan`: copy row ``src_rows[i]`` to ``dst_rows[i]`` where masked
    (``mask=None``: where both rows are ``>= 0``, tested in the kernel: no mask kernels)."""
    sr = src_rows.reshape(-1)
    dr = dst_rows.reshape(-1)
    mk = sr if mask is None else mask.reshape(-1)  # (a placeholder when there is no mask)
    if mk.dtype == torch.bool:
        mk = mk.view(torch.uint8)
    n = min(sr.numel(), dr.numel(), mk.numel())
    if n == 0:
        return
    sw, s_sb, s_sr, rw = _words(src)
    dw, d_sb, d_sr, rw2 = _words(dst)
    if rw != rw2:
        raise ValueError(f"row sizes differ: src {4 * rw} B, dst {4 * rw2} B")
    t, rwp, nw = _copy_tile_shape(rw)
    g = _num_programs(dst.device, triton.cdiv(n, t))
    _gather_plan_kernel[(g,)](
        sw, s_sb, s_sr, dw, d_sb, d_sr,
        sr.contiguous(), dr.contiguous(), mk.contiguous(), n, src.shape[1], dst.shape[1], g,
        RW=rw, RWP=rwp, T=t, HAS_MASK=mask is not None, num_warps=nw,
    )  # fmt: skip


def scatter_rows(values: Tensor, region: Tensor, slots: Tensor) -> None:
    """Triton `reference.scatter_rows`: row ``i`` of ``values`` into ``region`` row
    ``slots[i]`` where ``slots[i] >= 0`` (16-byte aligned rows, as `gather_plan`'s)."""
    n = values.shape[0]
    if n == 0:
        return
    dw, d_sb, d_sr, rw = _words(region)
    sw, s_sb, s_sr, rw2 = _words(values.unsqueeze(1))
    if rw != rw2:
        raise ValueError(f"row sizes differ: values {4 * rw2} B, region {4 * rw} B")
    t, rwp, nw = _copy_tile_shape(rw)
    g = _num_programs(region.device, triton.cdiv(n, t))
    dr = slots.reshape(-1).contiguous()
    _gather_plan_kernel[(g,)](
        sw, s_sb, s_sr, dw, d_sb, d_sr, dr, dr, dr, n, 1, region.shape[1], g,
        RW=rw, RWP=rwp, T=t, HAS_MASK=False, SRC_IS_INDEX=True, num_warps=nw,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# invalidate_written_slots
# --------------------------------------------------------------------------------------------


@triton.jit
def _invalidate_kernel(
    hot_index_ptr, s_hi_s, s_hi_h, state_ptr, Q, row_req_ptr, written_ptr, H,
    src_ptr, s_sb, s_sr, dst_ptr, d_sb, d_sr, srow_ptr, bs_s, bs_d,
    BH: tl.constexpr, MIRROR: tl.constexpr, RW: tl.constexpr, RWP: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    q = tl.load(row_req_ptr + i)
    r = tl.load(written_ptr + i).to(tl.int64)
    if MIRROR:  # `gather_plan` of this row first (src row -> written row, both valid)
        sr = tl.load(srow_ptr + i).to(tl.int64)
        if (sr >= 0) & (r >= 0):
            w = tl.arange(0, RWP)
            so = tl.multiple_of((sr // bs_s) * s_sb + (sr % bs_s) * s_sr, 4)
            do = tl.multiple_of((r // bs_d) * d_sb + (r % bs_d) * d_sr, 4)
            v = tl.load(src_ptr + so + w, mask=w < RW)
            tl.store(dst_ptr + do + w, v, mask=w < RW)
    if (q >= 0) & (r >= 0):
        s = tl.load(state_ptr + tl.minimum(q, Q - 1)).to(tl.int64)
        if s >= 0:
            bh = tl.arange(0, BH)
            for h0 in range(0, H, BH):
                h = h0 + bh
                ptr = hot_index_ptr + s * s_hi_s + h * s_hi_h
                v = tl.load(ptr, mask=h < H, other=-1)
                # Racing programs only ever write -1 over a matching row: benign.
                tl.store(ptr, tl.full([BH], -1, tl.int32), mask=(h < H) & (v.to(tl.int64) == r))


def invalidate_written_slots(
    hot_index: Tensor,
    request_state_indices: Tensor,
    row_req: Tensor,
    written_rows: Tensor,
    *,
    mirror: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Triton `reference.invalidate_written_slots`: one program per written row.

    ``mirror=(src, dst, src_rows)`` (keyword only; `INVALIDATE_MIRRORS`): the same programs
    first do ``gather_plan(src, dst, src_rows, written_rows, None)`` (a decode step's host
    mirror of its new rows), one launch instead of two."""
    n = min(row_req.numel(), written_rows.numel())
    Q = request_state_indices.numel()
    if mirror is not None:
        src, dst, src_rows = mirror
        if src_rows.numel() < n:
            raise ValueError(f"mirror: {src_rows.numel()} source rows for {n} written rows")
        if Q == 0 or hot_index.numel() == 0:  # nothing to invalidate: the copy alone
            gather_plan(src, dst, src_rows[:n], written_rows[:n], None)
            return
    if n == 0 or Q == 0 or hot_index.numel() == 0:
        return
    H = hot_index.shape[1]
    written = written_rows.reshape(-1)
    if mirror is None:
        copy: tuple = (written, 0, 0, written, 0, 0, written, 1, 1)
        rw = rwp = 1
    else:
        sw, s_sb, s_sr, rw = _words(src)
        dw, d_sb, d_sr, rw2 = _words(dst)
        if rw != rw2:
            raise ValueError(f"row sizes differ: src {4 * rw} B, dst {4 * rw2} B")
        srows = src_rows.reshape(-1).contiguous()
        copy = (sw, s_sb, s_sr, dw, d_sb, d_sr, srows, src.shape[1], dst.shape[1])
        rwp = next_pow2(rw)
    _invalidate_kernel[(n,)](
        hot_index, hot_index.stride(0), hot_index.stride(1), request_state_indices, Q,
        row_req.reshape(-1), written, H, *copy,
        BH=min(next_pow2(H), 2048), MIRROR=mirror is not None, RW=rw, RWP=rwp, num_warps=4,
    )  # fmt: skip
