"""resolve_residency as Triton kernels (docs/design.md §6.2); the reference is the oracle.

Same signature as the reference, bit-identical outputs and state. Nothing synchronises with the
host or launches a grid sized by data, so a decode step that calls it can be captured in a CUDA
graph. `resolve_residency` picks the kernel: batches of up to ``RESOLVE_SPLIT_MAX_Q`` requests
run the split kernels of `triton_resolve_split` (several programs per request), larger ones the
one-program-per-request kernel here, which sorts nothing on its hot path. Its scratch lives in
global memory (L1/L2 resident) and the stages are ordered with CTA barriers:

1. the request's rows (in row order) and its ``rows x top_k`` entries; resident and ``-1``
   entries are written out at once;
2. every distinct host row gets one **cell** of a per-request bucket table (``2 x entries``
   buckets of 4 ways, emptied by the program): in round ``r`` each unplaced entry stores its
   row into way ``r`` of its bucket and reads it back; a row whose value stuck owns that cell
   (equal rows store equal values, so duplicates share a cell). Rows of the rare bucket with
   more than 4 distinct rows get overflow cells one by one. The smallest entry index per cell
   (``atomic_min``) marks the row's first appearance;
3. every hot slot reads its row's bucket (one 16-byte load) and the overflow cells: a match is
   a hit, and the cell is overwritten with the slot (``-2 - slot``);
4. miss heads (first appearances of cells still holding a row) are ranked in entry order by a
   prefix sum; one pass over ``lru`` ranks the evictable and the hit slots, which gives each
   slot its new LRU position in closed form and the evictable slot of each miss rank;
5. each miss head writes its slot into its cell; every entry then reads its cell's slot; the
   swap list is the miss heads ordered by host row: up to ``RESOLVE_SORT_WINDOW`` misses by one
   ``tl.sort`` of that many (host row, slot) keys, more by an all-pairs rank count in
   ``RESOLVE_RANK_TILE`` tiles, so the only sort left is that of the misses.

Why buckets (docs/benchmarks.md §5, measured and dropped): the kernel before it sorted every
``(host row, entry)`` key with ``tl.sort`` and measured slower at few misses; a linear-probing
table with CAS loops was slower than that sort; warps, hot-slot chunk and bucket count barely
move this one. Our reading, not timed stage by stage: the twenty-odd dependent passes of
scattered accesses (one program per request, so one SM's load/store unit each) set
the time, not any one stage; hence the split for small batches.

Limit (documented, not checked, because checking would synchronise): a request may own at
most ``max_rows_per_request`` rows in one call (default ``max(1, H // top_k)``, which is what
``device_buffer_size >= max_query_len * top_k`` guarantees at configuration time)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.runtime.ops.triton_common import (
    add_totals,
    decode_entries,
    grid_dependency_wait,
    hash_bucket,
    next_pow2,
    padding_rows_and_row_list,
    pdl,
    zero_count_tails,
)
from hisparse.runtime.ops.triton_resolve_split import resolve_split

Tensor = torch.Tensor

#: resolve_residency implementation: "bucket" (the one-program kernel, or the split below
#: ``RESOLVE_SPLIT_MAX_Q`` requests) or "split" (always the split: the tests' and the
#: benchmarks' way to run the split kernels at any size). These module settings are tuning
#: tables, set by tests and benchmarks only.
RESOLVE_IMPL = "bucket"
#: Batches of up to this many requests, with a hot buffer of at least ``top_k`` slots (the
#: HiSparse placement; all-GPU's resident-only resolve keeps one program), resolve with
#: `triton_resolve_split`: each request's work spread over ``RESOLVE_SPLIT_PROGRAMS``
#: programs (0: 16 up to 32 requests, else 8), where a small batch otherwise leaves it to a few
#: SMs. Measured faster up to 64 requests and slower above them, where the one-program kernel
#: already spreads over most SMs (docs/benchmarks.md §5). Only requests of at least
#: ``RESOLVE_SPLIT_MIN_ENTRIES`` entries (rows x top_k, each padded to a power of two) split:
#: smaller ones (GQA's top_k 256, the interpreter's test sizes) were not timed split.
RESOLVE_SPLIT_MAX_Q = 64
RESOLVE_SPLIT_PROGRAMS = 0
RESOLVE_SPLIT_MIN_ENTRIES = 1024
#: Warps per program (0: by size), hot-slot chunk, rank tile of the swap-list order, and
#: log2 of the bucket count (``None``: 2 buckets per entry; tests shrink it to force overflow).
RESOLVE_WARPS = 0
RESOLVE_BH = 2048
RESOLVE_RANK_TILE = 64
RESOLVE_LOG_BUCKETS: int | None = None
#: Up to this many misses (a power of two; 0: off) the swap list is ordered by one ``tl.sort``
#: of just that many keys instead of the rank tiles: faster at 20% misses, even at 5%
#: (docs/benchmarks.md §5); a 1024-key window, larger rank tiles and one sort of all entries
#: were slower.
RESOLVE_SORT_WINDOW = 512


@triton.jit
def _store_sorted_swaps(
    rows, slots, keep, n_keep, idx, hot_bt_row, s_hbt_b, src_row, s_src, dst_row, s_dst, bs,
    SIZE: tl.constexpr,
):  # fmt: skip
    """Swap list entries ``0..n_keep-1`` ascending by host row: one ``tl.sort`` of the ``SIZE``
    ``(row << 32 | slot)`` keys (``keep`` lanes, ``n_keep`` of them; the others sort last)."""
    key = (rows.to(tl.int64) << 32) | slots.to(tl.int64)
    key = tl.where(keep, key, tl.full([SIZE], 0x7FFFFFFFFFFFFFFF, tl.int64))
    key = tl.sort(key, 0)
    ok = idx < n_keep
    row = (key >> 32).to(tl.int32)
    slot = (key & 0xFFFFFFFF).to(tl.int32)
    hb = tl.load(hot_bt_row + (slot // bs) * s_hbt_b, mask=ok)
    tl.store(src_row + idx * s_src, row, mask=ok)
    tl.store(dst_row + idx * s_dst, hb.to(tl.int64) * bs + slot % bs, mask=ok)


@triton.jit
def _resolve_kernel(
    topk_ptr, stk_r, stk_c,
    row_req_ptr, R,
    state_ptr, Q,
    src_bt_ptr, s_src_q, s_src_b,
    res_bt_ptr, s_res_q, s_res_b,
    hot_bt_ptr, s_hbt_s, s_hbt_b,
    hot_index_ptr, s_hi_s, s_hi_h,
    lru_ptr, s_lru_s, s_lru_h,
    out_ptr, s_out_r, s_out_c,
    swap_src_ptr, s_ss_q, s_ss_h,
    swap_dst_ptr, s_sd_q, s_sd_h,
    swap_count_ptr, s_sc,
    valid_ptr, s_v,
    hm_ptr, s_hm_q, s_hm_c,
    sc_rows_ptr, tab_ptr, first_ptr, hit_ptr, evict_ptr, newlru_ptr, mg_ptr, ms_ptr,
    K, H, bs, totals_ptr, n_layers, n_sc, n_hm,
    ROWS: tl.constexpr, KP: tl.constexpr, LOGB: tl.constexpr, BH: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, S: tl.constexpr, SORT_WINDOW: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_VALID: tl.constexpr, HAS_HM: tl.constexpr,
    HAS_TOTALS: tl.constexpr,
):  # fmt: skip
    """resolve_residency, one program per request, with a bucket table (module docstring)."""
    N: tl.constexpr = ROWS * KP
    WAYS: tl.constexpr = 4
    NCELL: tl.constexpr = (1 << LOGB) * WAYS  # bucket cells; overflow cells follow
    CS: tl.constexpr = NCELL + N  # cells per request
    q = tl.program_id(0)
    q64 = q.to(tl.int64)
    if q == 0:
        zero_count_tails(Q, swap_count_ptr, s_sc, n_sc, hm_ptr, s_hm_q, s_hm_c, n_hm, HAS_HM)
    rows = sc_rows_ptr + q64 * ROWS
    # Rows of padding requests (spread over programs) and this request's rows, in row order.
    n_rows = padding_rows_and_row_list(
        q, True, row_req_ptr, R, state_ptr, Q, out_ptr, s_out_r, s_out_c, valid_ptr, s_v, K,
        rows, KP, ROWS, BR, HAS_VALID,
    )  # fmt: skip

    s = tl.load(state_ptr + q)
    if s < 0:
        tl.store(swap_count_ptr + q64 * s_sc, 0)
        if HAS_HM:
            tl.store(hm_ptr + q64 * s_hm_q, 0)
            tl.store(hm_ptr + q64 * s_hm_q + s_hm_c, 0)
    else:
        s64 = s.to(tl.int64)
        tab = tab_ptr + q64 * CS
        first = first_ptr + q64 * CS
        base_h = q64 * H
        base_n = q64 * N
        # ---- 1. empty bucket cells --------------------------------------------------
        bc = tl.arange(0, BC)
        for c0 in tl.static_range(0, NCELL, BC):
            tl.store(tab + c0 + bc, tl.full([BC], -1, tl.int32))
        tl.debug_barrier()  # (the row list is written too)

        # ---- 2. entries (flat, entry order); resident and -1 entries written at once ---
        e = tl.arange(0, N)
        row, col, valid, needs, g = decode_entries(
            e, rows, n_rows, topk_ptr, stk_r, stk_c, src_bt_ptr + q64 * s_src_q, s_src_b,
            res_bt_ptr + q64 * s_res_q, s_res_b, out_ptr, s_out_r, s_out_c, K, bs, KP, HAS_RES,
        )  # fmt: skip
        out_addr = out_ptr + row * s_out_r + col * s_out_c
        if HAS_VALID:
            vrow = tl.sum(tl.reshape(valid.to(tl.int32), [ROWS, KP]), 1)
            rr = tl.arange(0, ROWS)
            vr = tl.load(rows + rr, mask=rr < n_rows, other=0).to(tl.int64)
            tl.store(valid_ptr + vr * s_v, vrow, mask=rr < n_rows)

        # ---- 3. one cell per distinct host row: round r claims way r of its bucket -----
        b = hash_bucket(g, LOGB)
        pending = needs
        cell = tl.zeros([N], tl.int32)
        for wr in tl.static_range(WAYS):
            c = b * WAYS + wr
            tl.store(tab + c, g, mask=pending)
            tl.debug_barrier()
            got = tl.load(tab + c, mask=pending, other=-1, cache_modifier=".cg")
            won = pending & (got == g)  # this row's value stuck (equal rows share the cell)
            cell = tl.where(won, c, cell)
            pending = pending & ~won
        # Rows whose bucket overflowed: one overflow cell per distinct row (rare).
        n_ovf = 0
        while tl.max(pending.to(tl.int32), 0) > 0:
            e0 = tl.min(tl.where(pending, e, N), 0)
            g0 = tl.sum(tl.where(e == e0, g, 0), 0)
            same = pending & (g == g0)
            cell = tl.where(same, NCELL + n_ovf, cell)
            tl.store(tab + NCELL + n_ovf, g0)
            pending = pending & ~same
            n_ovf += 1
        # First appearance of each row: any of its entries, then the smallest.
        tl.store(first + cell, e, mask=needs)
        tl.debug_barrier()
        tl.atomic_min(first + cell, e, mask=needs, sem="relaxed")

        # ---- 4. hits: each hot slot looks for its row in its bucket (and the overflow) ---
        n_hit = 0
        bh = tl.arange(0, BH)
        ways = tl.arange(0, WAYS)[None, :]
        for h0 in range(0, H, BH):
            h = h0 + bh
            hm = h < H
            v = tl.load(hot_index_ptr + s64 * s_hi_s + h * s_hi_h, mask=hm, other=-1)
            occ = hm & (v >= 0)
            vc = hash_bucket(tl.maximum(v, 0), LOGB) * WAYS
            tile = tl.load(
                tab + vc[:, None] + ways, mask=occ[:, None], other=-1, cache_modifier=".cg"
            )
            way = tl.max(tl.where(tile == v[:, None], ways, -1), 1)
            hit = occ & (way >= 0)
            hcell = vc + way
            for k in range(n_ovf):
                gk = tl.load(tab + NCELL + k, cache_modifier=".cg")
                mk = occ & (v == gk)
                hit = hit | mk
                hcell = tl.where(mk, NCELL + k, hcell)
            # A hit cell now holds its slot (-2 - slot: below every row and below "empty").
            tl.store(tab + hcell, -2 - h, mask=hit)
            tl.store(hit_ptr + base_h + h, hit.to(tl.int8), mask=hm)
            n_hit += tl.sum(hit.to(tl.int32), 0)
        tl.debug_barrier()

        # ---- 5. misses: heads (first appearances) in entry order ----------------------
        val = tl.load(tab + cell, mask=needs, other=-1, cache_modifier=".cg")
        miss = needs & (val >= 0)
        fe = tl.load(first + cell, mask=miss, other=-1, cache_modifier=".cg")
        head = miss & (fe == e)
        n_miss = tl.sum(head.to(tl.int32), 0)
        mrank = tl.cumsum(head.to(tl.int32), 0) - 1
        n_evict = H - n_hit
        # Misses that get a slot: all of them, unless more rows were wanted than H (the
        # configuration checks prevent it; the reference raises): then the first n_evict.
        n_take = tl.minimum(n_miss, n_evict)

        # ---- 6. new LRU order in closed form; evictable slot of each miss rank ---------
        ce = 0
        ch = 0
        for j0 in range(0, H, BH):
            j = j0 + bh
            jm = j < H
            sl = tl.load(lru_ptr + s64 * s_lru_s + j * s_lru_h, mask=jm, other=0).to(tl.int32)
            was_hit = tl.load(hit_ptr + base_h + sl, mask=jm, other=0) != 0
            ev = jm & ~was_hit
            hh = jm & was_hit
            ei = ce + tl.cumsum(ev.to(tl.int32), 0) - 1
            kh = ch + tl.cumsum(hh.to(tl.int32), 0) - 1
            newpos = tl.where(
                hh, n_evict + kh, tl.where(ei >= n_take, ei - n_take, n_evict - n_take + ei)
            )
            ok = jm & (newpos >= 0) & (newpos < H)
            tl.store(newlru_ptr + base_h + newpos, sl.to(tl.int16), mask=ok)
            tl.store(evict_ptr + base_h + ei, sl, mask=ev & (ei < n_take))
            ce += tl.sum(ev.to(tl.int32), 0)
            ch += tl.sum(hh.to(tl.int32), 0)
        tl.debug_barrier()

        # ---- 7. each miss head takes its evictable slot; its cell holds the slot -------
        fm = head & (mrank < n_take)
        slot_m = tl.load(evict_ptr + base_h + mrank, mask=fm, other=0)
        tl.store(hot_index_ptr + s64 * s_hi_s + slot_m * s_hi_h, g, mask=fm)
        tl.store(tab + cell, -2 - slot_m, mask=fm)
        tl.store(mg_ptr + base_n + mrank, g, mask=fm)
        tl.store(ms_ptr + base_n + mrank, slot_m, mask=fm)
        tl.store(swap_count_ptr + q64 * s_sc, n_take)
        if HAS_HM:
            tl.store(hm_ptr + q64 * s_hm_q, n_hit)
            tl.store(hm_ptr + q64 * s_hm_q + s_hm_c, n_miss)
        if HAS_TOTALS:
            add_totals(totals_ptr, n_hit, n_miss, n_layers)
        for j0 in range(0, H, BH):
            j = j0 + bh
            jm = j < H
            nl = tl.load(newlru_ptr + base_h + j, mask=jm)
            tl.store(lru_ptr + s64 * s_lru_s + j * s_lru_h, nl, mask=jm)
        tl.debug_barrier()

        # ---- 8. every hot entry reads its row's slot ------------------------------------
        val = tl.load(tab + cell, mask=needs, other=-2, cache_modifier=".cg")
        slot_all = -2 - val
        placed = needs & (val < -1)  # always, unless more rows were wanted than H
        hb = tl.load(hot_bt_ptr + s64 * s_hbt_s + (slot_all // bs) * s_hbt_b, mask=placed)
        tl.store(out_addr, hb.to(tl.int64) * bs + slot_all % bs, mask=placed)
        # (configuration checks keep this empty; the reference raises) never a stale row
        tl.store(out_addr, -1, mask=needs & ~placed)

        # ---- 9. swap list ascending by host row --------------------------------------
        n_sw = n_take
        if SORT_WINDOW > 0:  # noqa: SIM102 (constexpr, then a runtime branch)
            if n_sw <= SORT_WINDOW:
                # Few misses: sort just the first SORT_WINDOW of the compact miss list.
                w = tl.arange(0, SORT_WINDOW)
                wm = w < n_sw
                gw = tl.load(mg_ptr + base_n + w, mask=wm, other=0)
                sw = tl.load(ms_ptr + base_n + w, mask=wm, other=0)
                _store_sorted_swaps(
                    gw, sw, wm, n_sw, w, hot_bt_ptr + s64 * s_hbt_s, s_hbt_b,
                    swap_src_ptr + q64 * s_ss_q, s_ss_h, swap_dst_ptr + q64 * s_sd_q, s_sd_h, bs,
                    SORT_WINDOW,
                )  # fmt: skip
                n_sw = 0
        si = tl.arange(0, S)
        for i0 in range(0, n_sw, S):
            i = i0 + si
            im = i < n_sw
            gi = tl.load(mg_ptr + base_n + i, mask=im, other=0)
            # Count element-wise over the column tiles, reduce across threads once: a
            # reduction per tile made the rank tiles several times slower when every entry misses.
            less = tl.zeros([S, S], tl.int32)
            for j0 in range(0, n_sw, S):
                jj = j0 + si
                gj = tl.load(mg_ptr + base_n + jj, mask=jj < n_sw, other=0x7FFFFFFF)
                less += (gj[None, :] < gi[:, None]).to(tl.int32)
            rank = tl.sum(less, 1)
            slot_i = tl.load(ms_ptr + base_n + i, mask=im, other=0)
            hb_i = tl.load(hot_bt_ptr + s64 * s_hbt_s + (slot_i // bs) * s_hbt_b, mask=im)
            tl.store(swap_src_ptr + q64 * s_ss_q + rank * s_ss_h, gi, mask=im)
            tl.store(
                swap_dst_ptr + q64 * s_sd_q + rank * s_sd_h,
                hb_i.to(tl.int64) * bs + slot_i % bs,
                mask=im,
            )


def resolve_residency(
    topk: Tensor,
    row_req: Tensor,
    request_state_indices: Tensor,
    source_block_table: Tensor,
    resident_block_table: Tensor | None,
    hot_block_table: Tensor,
    hot_index: Tensor,
    lru: Tensor,
    block_size: int,
    out_physical: Tensor,
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
    valid_counts: Tensor | None = None,
    hit_miss: Tensor | None = None,
    *,
    max_rows_per_request: int | None = None,
    totals: Tensor | None = None,
    n_layers: int = 1,
) -> None:
    """Triton `reference.resolve_residency`; same arguments, outputs and state updates.

    ``max_rows_per_request`` (keyword only, not in the reference) bounds the rows one request
    may own in this call; it sizes the program's entry vector (``pow2(rows) * pow2(top_k)``),
    so a decode-only caller passes 1. Default: ``max(1, min(R, H // top_k))``.
    ``totals`` (keyword only, not in the reference; `RESOLVE_ADDS_TOTALS`): int64 ``[3]``
    running hits, misses and rows moved (misses × ``n_layers``), added to by each request's
    program (atomics), so the caller launches no counting kernels.
    """
    if RESOLVE_SORT_WINDOW < 0 or RESOLVE_SORT_WINDOW & (RESOLVE_SORT_WINDOW - 1):
        raise ValueError(
            f"RESOLVE_SORT_WINDOW={RESOLVE_SORT_WINDOW}: use 0 (off) or a power of two such as 512"
        )
    if RESOLVE_IMPL not in ("bucket", "split"):
        raise ValueError(f"RESOLVE_IMPL={RESOLVE_IMPL!r}: use bucket or split")
    p = RESOLVE_SPLIT_PROGRAMS
    if p < 0 or p & (p - 1):
        raise ValueError(f"RESOLVE_SPLIT_PROGRAMS={p}: use 0 (by batch) or a power of two")
    R, K = topk.shape
    Q = request_state_indices.shape[0]
    H = hot_index.shape[1]
    if R == 0 or Q == 0:
        # Nothing to resolve; keep the reference's zero-fills (fixed shapes, no sync).
        out_physical[:R].fill_(-1)
        if valid_counts is not None:
            valid_counts[:R].zero_()
        swap_count.zero_()
        if hit_miss is not None:
            hit_miss.zero_()
        return
    # Like the reference, the first launch zeroes the counts past this call's Q requests
    # (`zero_count_tails`): buffers sized for more requests feed the gathers' fixed grids.
    if max_rows_per_request is None:
        max_rows_per_request = max(1, min(R, H // max(K, 1)))
    rows = next_pow2(max(1, min(R, max_rows_per_request)))
    kp = next_pow2(max(K, 1))
    n = rows * kp
    logn = n.bit_length() - 1
    br = 256  # fixed: one compiled variant for every batch size
    dev = topk.device
    res = resident_block_table if resident_block_table is not None else source_block_table
    vc = valid_counts if valid_counts is not None else swap_count
    hm = hit_miss if hit_miss is not None else swap_count.view(-1, 1)
    tot = totals if totals is not None else swap_count
    common = (
        topk, topk.stride(0), topk.stride(1),
        row_req, R,
        request_state_indices, Q,
        source_block_table, source_block_table.stride(0), source_block_table.stride(1),
        res, res.stride(0), res.stride(1),
        hot_block_table, hot_block_table.stride(0), hot_block_table.stride(1),
        hot_index, hot_index.stride(0), hot_index.stride(1),
        lru, lru.stride(0), lru.stride(1),
        out_physical, out_physical.stride(0), out_physical.stride(1),
        swap_src, swap_src.stride(0), swap_src.stride(1),
        swap_dst, swap_dst.stride(0), swap_dst.stride(1),
        swap_count, swap_count.stride(0),
        vc, vc.stride(0),
        hm, hm.stride(0), hm.stride(1) if hm.dim() > 1 else 1,
    )  # fmt: skip
    flags = dict(
        HAS_RES=resident_block_table is not None,
        HAS_VALID=valid_counts is not None,
        HAS_HM=hit_miss is not None,
    )
    # Buckets: 2 per entry by default (4 ways each: a bucket overflows with ~1e-4 odds).
    logb = RESOLVE_LOG_BUCKETS if RESOLVE_LOG_BUCKETS is not None else logn + 1
    if RESOLVE_IMPL == "split" or (
        Q <= RESOLVE_SPLIT_MAX_Q and H >= K and n >= RESOLVE_SPLIT_MIN_ENTRIES
    ):
        programs = RESOLVE_SPLIT_PROGRAMS or (16 if Q <= 32 else 8)
        resolve_split(common, flags, Q, rows, kp, logb, H, K, block_size, dev, programs,
                      tot, n_layers, totals is not None)  # fmt: skip
        return
    ncell = 4 << logb
    cs = ncell + n
    # One scratch allocation per call (graph-capturable: the graph's pool owns it); the
    # kernel empties the bucket cells itself and writes every other cell before reading it.
    i32 = torch.empty(Q * (rows + 2 * cs + H + 2 * n), dtype=torch.int32, device=dev)
    i16 = torch.empty(Q * H, dtype=torch.int16, device=dev)
    i8 = torch.empty(Q * H, dtype=torch.int8, device=dev)
    parts = []
    o = 0
    for size in (Q * rows, Q * cs, Q * cs, Q * H, Q * n, Q * n):
        parts.append(i32[o : o + size])
        o += size
    sc_rows, tab, first, evict, mg, ms = parts
    bh = min(next_pow2(H), RESOLVE_BH)
    window = min(RESOLVE_SORT_WINDOW, n)
    _resolve_kernel[(Q,)](
        *common,
        sc_rows, tab, first, i8, evict, i16, mg, ms,
        K, H, block_size, tot, n_layers, swap_count.shape[0],
        hit_miss.shape[0] if hit_miss is not None else 0,
        ROWS=rows, KP=kp, LOGB=logb, BH=bh, BR=br, BC=min(ncell, 4096), S=RESOLVE_RANK_TILE,
        SORT_WINDOW=window if window >= 2 else 0, HAS_TOTALS=totals is not None,
        **flags,
        num_warps=RESOLVE_WARPS or (8 if max(n, bh) <= 4096 else 16),
    )  # fmt: skip


@triton.jit
def _resident_rows_kernel(
    topk, s_tr, s_tk, row_req, table, s_br, s_bc, out, s_or, s_ok, valid, K, block_size,
    HAS_VALID: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BK)
    m = k < K
    pos = tl.load(topk + r * s_tr + k * s_tk, mask=m, other=-1)
    req = tl.load(row_req + r).to(tl.int64)
    live = m & (pos >= 0) & (req >= 0)
    blk = tl.load(table + req * s_br + (pos // block_size).to(tl.int64) * s_bc, mask=live, other=0)
    phys = tl.where(live & (blk > 0), blk * block_size + pos % block_size, -1)
    tl.store(out + r * s_or + k * s_ok, phys, mask=m)
    if HAS_VALID:
        tl.store(valid + r, tl.sum((phys >= 0).to(tl.int32), axis=0))


def resident_rows(
    topk: Tensor,
    row_req: Tensor,
    resident_block_table: Tensor,
    block_size: int,
    out_physical: Tensor,
    valid_counts: Tensor | None = None,
) -> None:
    """Triton `reference.resident_rows` (one launch; an all-GPU decode step's lookup)."""
    rows, k = topk.shape
    if rows == 0:
        return
    table = resident_block_table
    row_req = row_req.contiguous()  # read at offset r (a no-op on the runtime's buffers)
    vc = valid_counts if valid_counts is not None else out_physical
    if valid_counts is not None and valid_counts.stride(0) != 1:
        raise ValueError("valid_counts must have unit stride")
    _resident_rows_kernel[(rows,)](
        topk, topk.stride(0), topk.stride(1), row_req, table, table.stride(0), table.stride(1),
        out_physical, out_physical.stride(0), out_physical.stride(1), vc, k, block_size,
        HAS_VALID=valid_counts is not None, BK=next_pow2(max(k, 1)), num_warps=4,
        **pdl(topk.device),
    )  # fmt: skip
