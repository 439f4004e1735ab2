"""resolve_residency for small batches: each request's work spread over ``P`` programs.

The one-program-per-request kernel (`triton_resolve._resolve_kernel`) leaves a batch-1 decode
step's resolve to one SM: ~30 full-width passes of scattered 4-byte accesses over every entry
and hot slot, whatever the miss rate. Here the same stages
run as five launches over a ``(Q, P)`` grid, each program taking ``1/P`` of the request's
entries and hot slots; the kernel boundaries are the barriers between stages, so nothing
spins and the CPU interpreter runs it as is. Same outputs and state as the reference, bit for
bit:

0. one fill empties every request's bucket table and first-appearance table (``-1``);
1. entries: physical rows of resident entries written at once; every distinct host row
   claims one cell with ``atomic_cas`` (way ``r`` of its bucket in round ``r``, then overflow
   cells probed in order, so equal rows always meet in one cell); ``atomic_max(N - e)`` keeps
   the row's first entry;
2. hot slots: a slot whose row has a cell is a hit; the cell then holds ``-2 - slot``;
3. counts per program: miss heads (first entries of cells still holding a row) in its entry
   range, evictable and hit slots in its range of the LRU order;
4. prefix sums over the programs' counts give each miss head its rank and each slot its new
   LRU position and (evictable) the miss rank it serves;
5. every entry's slot (a hit's, or its cell's head's evicted slot), the heads' ``hot_index``
   writes, the LRU copy, and the swap list ordered by host row (all-pairs ranks: the misses'
   rows are distinct).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.runtime.ops.triton_common import (
    add_totals,
    decode_entries,
    hash_bucket,
    next_pow2,
    padding_rows_and_row_list,
    zero_count_tails,
)

Tensor = torch.Tensor

#: The rank tile of the swap-list order.
SPLIT_RANK_TILE = 64
_WAYS = 4


@triton.jit
def _split_entries_kernel(
    topk_ptr, stk_r, stk_c, row_req_ptr, R, state_ptr, Q,
    src_bt_ptr, s_src_q, s_src_b, res_bt_ptr, s_res_q, s_res_b,
    out_ptr, s_out_r, s_out_c, swap_count_ptr, s_sc, valid_ptr, s_v, hm_ptr, s_hm_q, s_hm_c,
    tab_ptr, first_ptr, dummy_ptr, rows_ptr, ent_g_ptr, ent_cell_ptr,
    K, bs, n_sc, n_hm,
    ROWS: tl.constexpr, KP: tl.constexpr, LOGB: tl.constexpr, C: tl.constexpr,
    BR: tl.constexpr, HAS_RES: tl.constexpr, HAS_VALID: tl.constexpr, HAS_HM: tl.constexpr,
):  # fmt: skip
    """Stage 1: each program's ``C`` entries; rows claim cells (module docstring)."""
    N: tl.constexpr = ROWS * KP
    NCELL: tl.constexpr = (1 << LOGB) * 4
    CS: tl.constexpr = NCELL + N
    q = tl.program_id(0)
    p = tl.program_id(1)
    q64 = q.to(tl.int64)
    if (q == 0) & (p == 0):
        zero_count_tails(Q, swap_count_ptr, s_sc, n_sc, hm_ptr, s_hm_q, s_hm_c, n_hm, HAS_HM)
    rows = rows_ptr + q64 * ROWS
    n_rows = padding_rows_and_row_list(
        q, p == 0, row_req_ptr, R, state_ptr, Q, out_ptr, s_out_r, s_out_c, valid_ptr, s_v, K,
        rows, KP, ROWS, BR, HAS_VALID,
    )  # fmt: skip
    s = tl.load(state_ptr + q)
    if s < 0:
        if p == 0:
            tl.store(swap_count_ptr + q64 * s_sc, 0)
            if HAS_HM:
                tl.store(hm_ptr + q64 * s_hm_q, 0)
                tl.store(hm_ptr + q64 * s_hm_q + s_hm_c, 0)
    else:
        tl.debug_barrier()  # this program's row list is written
        if HAS_VALID:  # noqa: SIM102 (constexpr, then a runtime branch)
            if p == 0:
                rr = tl.arange(0, ROWS)
                kk = tl.arange(0, KP)
                rm = rr < n_rows
                rw = tl.load(rows + rr, mask=rm, other=0).to(tl.int64)
                t = tl.load(
                    topk_ptr + rw[:, None] * stk_r + kk[None, :] * stk_c,
                    mask=rm[:, None] & (kk < K)[None, :],
                    other=-1,
                )
                tl.store(valid_ptr + rw * s_v, tl.sum((t >= 0).to(tl.int32), 1), mask=rm)
        e = p * C + tl.arange(0, C)
        _row, _col, _valid, needs, g = decode_entries(
            e, rows, n_rows, topk_ptr, stk_r, stk_c, src_bt_ptr + q64 * s_src_q, s_src_b,
            res_bt_ptr + q64 * s_res_q, s_res_b, out_ptr, s_out_r, s_out_c, K, bs, KP, HAS_RES,
        )  # fmt: skip

        # Cells: way r of the bucket in round r, then the overflow cells in order. Cells go
        # from empty to a row once, so every entry of a row walks the same cells and meets
        # the others in the first cell that is empty or holds that row.
        tab = tab_ptr + q64 * CS
        dummy = dummy_ptr + q64 * N + e  # where lanes with nothing to claim point (no mask)
        b = hash_bucket(g, LOGB)
        pending = needs
        empty = tl.full([C], -1, tl.int32)  # (a tensor: the interpreter's CAS needs one)
        cell = empty
        for wr in tl.static_range(4):
            c = b * 4 + wr
            old = tl.atomic_cas(tl.where(pending, tab + c, dummy), empty, g, sem="relaxed")
            won = pending & ((old == -1) | (old == g))
            cell = tl.where(won, c, cell)
            pending = pending & ~won
        k = 0
        while tl.max(pending.to(tl.int32), 0) > 0:
            old = tl.atomic_cas(tl.where(pending, tab + NCELL + k, dummy), empty, g, sem="relaxed")
            won = pending & ((old == -1) | (old == g))
            cell = tl.where(won, NCELL + k, cell)
            pending = pending & ~won
            k += 1
        tl.atomic_max(first_ptr + q64 * CS + cell, N - e, mask=needs, sem="relaxed")
        tl.store(ent_g_ptr + q64 * N + e, g)
        tl.store(ent_cell_ptr + q64 * N + e, tl.where(needs, cell, -1))


@triton.jit
def _split_hits_kernel(
    state_ptr, hot_index_ptr, s_hi_s, s_hi_h, tab_ptr, hit_ptr, parts_ptr, H,
    N: tl.constexpr, LOGB: tl.constexpr, BHS: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """Stage 2: each program's ``BHS`` hot slots look their row up; a hit's cell holds it."""
    NCELL: tl.constexpr = (1 << LOGB) * 4
    CS: tl.constexpr = NCELL + N
    q = tl.program_id(0)
    p = tl.program_id(1)
    q64 = q.to(tl.int64)
    s = tl.load(state_ptr + q)
    if s >= 0:
        s64 = s.to(tl.int64)
        tab = tab_ptr + q64 * CS
        h = p * BHS + tl.arange(0, BHS)
        hm = h < H
        v = tl.load(hot_index_ptr + s64 * s_hi_s + h * s_hi_h, mask=hm, other=-1)
        occ = hm & (v >= 0)
        vc = hash_bucket(tl.maximum(v, 0), LOGB) * 4
        ways = tl.arange(0, 4)[None, :]
        tile = tl.load(tab + vc[:, None] + ways, mask=occ[:, None], other=-1)
        way = tl.max(tl.where(tile == v[:, None], ways, -1), 1)
        hit = occ & (way >= 0)
        hcell = vc + way
        k = 0
        gk = tl.load(tab + NCELL)
        while gk != -1:  # overflow cells fill in order from the first
            mk = occ & (v == gk)
            hit = hit | mk
            hcell = tl.where(mk, NCELL + k, hcell)
            k += 1
            gk = tl.load(tab + NCELL + k, mask=k < N, other=-1)
        tl.store(tab + hcell, -2 - h, mask=hit)
        tl.store(hit_ptr + q64 * H + h, hit.to(tl.int8), mask=hm)
        tl.store(parts_ptr + (q64 * P + p) * 4, tl.sum(hit.to(tl.int32), 0))


@triton.jit
def _split_count_kernel(
    state_ptr, lru_ptr, s_lru_s, s_lru_h, tab_ptr, first_ptr, ent_cell_ptr, head_ptr,
    hit_ptr, parts_ptr, H,
    N: tl.constexpr, LOGB: tl.constexpr, C: tl.constexpr, BHS: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """Stage 3: miss heads in this program's entries; evictable and hit slots in its part of
    the LRU order."""
    NCELL: tl.constexpr = (1 << LOGB) * 4
    CS: tl.constexpr = NCELL + N
    q = tl.program_id(0)
    p = tl.program_id(1)
    q64 = q.to(tl.int64)
    s = tl.load(state_ptr + q)
    if s >= 0:
        e = p * C + tl.arange(0, C)
        cell = tl.load(ent_cell_ptr + q64 * N + e)
        needs = cell >= 0
        val = tl.load(tab_ptr + q64 * CS + cell, mask=needs, other=-1)
        miss = needs & (val >= 0)
        fe = N - tl.load(first_ptr + q64 * CS + cell, mask=miss, other=0)
        head = miss & (fe == e)
        tl.store(head_ptr + q64 * N + e, head.to(tl.int8))
        j = p * BHS + tl.arange(0, BHS)
        jm = j < H
        sl = tl.load(lru_ptr + s.to(tl.int64) * s_lru_s + j * s_lru_h, mask=jm, other=0)
        was_hit = tl.load(hit_ptr + q64 * H + sl.to(tl.int32), mask=jm, other=0) != 0
        base = parts_ptr + (q64 * P + p) * 4
        tl.store(base + 1, tl.sum(head.to(tl.int32), 0))
        tl.store(base + 2, tl.sum((jm & ~was_hit).to(tl.int32), 0))
        tl.store(base + 3, tl.sum((jm & was_hit).to(tl.int32), 0))


@triton.jit
def _split_rank_kernel(
    state_ptr, lru_ptr, s_lru_s, s_lru_h, swap_count_ptr, s_sc, hm_ptr, s_hm_q, s_hm_c,
    ent_g_ptr, head_ptr, mrank_ptr, mg_ptr, hit_ptr, parts_ptr, evict_ptr, newlru_ptr, H,
    totals_ptr, n_layers,
    N: tl.constexpr, C: tl.constexpr, BHS: tl.constexpr, P: tl.constexpr,
    HAS_HM: tl.constexpr, HAS_TOTALS: tl.constexpr,
):  # fmt: skip
    """Stage 4: the programs' counts, summed before this one, rank its miss heads and its
    slots (the new LRU order in closed form, as the one-program kernel)."""
    q = tl.program_id(0)
    p = tl.program_id(1)
    q64 = q.to(tl.int64)
    s = tl.load(state_ptr + q)
    if s >= 0:
        pp = tl.arange(0, P)
        base = parts_ptr + (q64 * P + pp) * 4
        before = pp < p
        c_hit = tl.load(base)
        c_head = tl.load(base + 1)
        c_ev = tl.load(base + 2)
        c_hh = tl.load(base + 3)
        n_hit = tl.sum(c_hit, 0)
        n_miss = tl.sum(c_head, 0)
        n_evict = H - n_hit
        # Misses that get a slot: all of them, unless more rows were wanted than H (the
        # configuration checks prevent it; the reference raises): then the first n_evict.
        n_take = tl.minimum(n_miss, n_evict)
        # New LRU positions: evictable slots left unused, the slots just filled, the hits.
        j = p * BHS + tl.arange(0, BHS)
        jm = j < H
        sl = tl.load(lru_ptr + s.to(tl.int64) * s_lru_s + j * s_lru_h, mask=jm, other=0)
        sl = sl.to(tl.int32)
        was_hit = tl.load(hit_ptr + q64 * H + sl, mask=jm, other=0) != 0
        ev = jm & ~was_hit
        hh = jm & was_hit
        ei = tl.sum(tl.where(before, c_ev, 0), 0) + tl.cumsum(ev.to(tl.int32), 0) - 1
        kh = tl.sum(tl.where(before, c_hh, 0), 0) + tl.cumsum(hh.to(tl.int32), 0) - 1
        newpos = tl.where(
            hh, n_evict + kh, tl.where(ei >= n_take, ei - n_take, n_evict - n_take + ei)
        )
        ok = jm & (newpos >= 0) & (newpos < H)
        tl.store(newlru_ptr + q64 * H + newpos, sl.to(tl.int16), mask=ok)
        tl.store(evict_ptr + q64 * H + ei, sl, mask=ev & (ei < n_take))
        # Miss heads in entry order.
        e = p * C + tl.arange(0, C)
        head = tl.load(head_ptr + q64 * N + e) != 0
        mrank = tl.sum(tl.where(before, c_head, 0), 0) + tl.cumsum(head.to(tl.int32), 0) - 1
        tl.store(mrank_ptr + q64 * N + e, tl.where(head, mrank, -1))
        g = tl.load(ent_g_ptr + q64 * N + e, mask=head, other=0)
        tl.store(mg_ptr + q64 * N + mrank, g, mask=head)
        if p == 0:
            tl.store(swap_count_ptr + q64 * s_sc, n_take)
            if HAS_HM:
                tl.store(hm_ptr + q64 * s_hm_q, n_hit)
                tl.store(hm_ptr + q64 * s_hm_q + s_hm_c, n_miss)
            if HAS_TOTALS:
                add_totals(totals_ptr, n_hit, n_miss, n_layers)


@triton.jit
def _split_place_kernel(
    state_ptr, hot_bt_ptr, s_hbt_s, s_hbt_b, hot_index_ptr, s_hi_s, s_hi_h,
    lru_ptr, s_lru_s, s_lru_h, out_ptr, s_out_r, s_out_c,
    swap_src_ptr, s_ss_q, s_ss_h, swap_dst_ptr, s_sd_q, s_sd_h, swap_count_ptr, s_sc,
    tab_ptr, first_ptr, rows_ptr, ent_g_ptr, ent_cell_ptr, mrank_ptr, mg_ptr, evict_ptr,
    newlru_ptr, H, bs,
    ROWS: tl.constexpr, KP: tl.constexpr, LOGB: tl.constexpr, C: tl.constexpr,
    BHS: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """Stage 5: every entry's hot row, the heads' ``hot_index``, LRU copy, swap list."""
    N: tl.constexpr = ROWS * KP
    NCELL: tl.constexpr = (1 << LOGB) * 4
    CS: tl.constexpr = NCELL + N
    q = tl.program_id(0)
    p = tl.program_id(1)
    q64 = q.to(tl.int64)
    s = tl.load(state_ptr + q)
    if s >= 0:
        s64 = s.to(tl.int64)
        hot_bt = hot_bt_ptr + s64 * s_hbt_s
        e = p * C + tl.arange(0, C)
        cell = tl.load(ent_cell_ptr + q64 * N + e)
        needs = cell >= 0
        val = tl.load(tab_ptr + q64 * CS + cell, mask=needs, other=-1)
        is_hit = needs & (val < -1)
        is_miss = needs & ~is_hit
        n_sw = tl.load(swap_count_ptr + q64 * s_sc)  # misses that got a slot
        e0 = N - tl.load(first_ptr + q64 * CS + cell, mask=is_miss, other=0)
        r0 = tl.load(mrank_ptr + q64 * N + e0, mask=is_miss, other=0)
        placed_m = is_miss & (r0 < n_sw)  # always, unless more rows were wanted than H
        slot_m = tl.load(evict_ptr + q64 * H + r0, mask=placed_m, other=0)
        slot = tl.where(is_hit, -2 - val, slot_m)
        placed = is_hit | placed_m
        ri = e // KP
        col = e % KP
        row = tl.load(rows_ptr + q64 * ROWS + ri, mask=needs, other=0).to(tl.int64)
        out_addr = out_ptr + row * s_out_r + col * s_out_c
        hb = tl.load(hot_bt + (slot // bs) * s_hbt_b, mask=placed, other=0)
        tl.store(out_addr, hb.to(tl.int64) * bs + slot % bs, mask=placed)
        tl.store(out_addr, -1, mask=needs & ~placed)  # the reference raises; never stale
        g = tl.load(ent_g_ptr + q64 * N + e, mask=placed_m, other=0)
        tl.store(hot_index_ptr + s64 * s_hi_s + slot_m * s_hi_h, g, mask=placed_m & (e0 == e))
        j = p * BHS + tl.arange(0, BHS)
        jm = j < H
        nl = tl.load(newlru_ptr + q64 * H + j, mask=jm)
        tl.store(lru_ptr + s64 * s_lru_s + j * s_lru_h, nl, mask=jm)
        # Swap list ascending by host row: rank = misses with a smaller row (rows distinct).
        si = tl.arange(0, S)
        mg = mg_ptr + q64 * N
        for i0 in range(p * S, n_sw, P * S):
            i = i0 + si
            im = i < n_sw
            gi = tl.load(mg + i, mask=im, other=0)
            less = tl.zeros([S, S], tl.int32)
            for j0 in range(0, n_sw, S):
                jj = j0 + si
                gj = tl.load(mg + jj, mask=jj < n_sw, other=0x7FFFFFFF)
                less += (gj[None, :] < gi[:, None]).to(tl.int32)
            rank = tl.sum(less, 1)
            slot_i = tl.load(evict_ptr + q64 * H + i, mask=im, other=0)
            hb_i = tl.load(hot_bt + (slot_i // bs) * s_hbt_b, mask=im, other=0)
            tl.store(swap_src_ptr + q64 * s_ss_q + rank * s_ss_h, gi, mask=im)
            tl.store(
                swap_dst_ptr + q64 * s_sd_q + rank * s_sd_h,
                hb_i.to(tl.int64) * bs + slot_i % bs,
                mask=im,
            )


def resolve_split(common: tuple, flags: dict, Q: int, rows: int, kp: int, logb: int, H: int,
                  K: int, block_size: int, dev: torch.device, programs: int,
                  totals: torch.Tensor, n_layers: int, has_totals: bool) -> None:  # fmt: skip
    """Launch the five stages (plus one fill) for ``Q`` requests of ``rows x kp`` entries,
    ``programs`` (a power of two) per request; ``has_totals``: add the hits, misses and rows
    moved to ``totals`` (`triton_resolve.resolve_residency`).

    ``common`` is `triton_resolve.resolve_residency`'s argument tuple (tensors and strides in
    the reference's order); ``flags`` its ``HAS_*`` switches.
    """
    (topk, stk_r, stk_c, row_req, R, state, _, src_bt, s_src_q, s_src_b, res_bt, s_res_q,
     s_res_b, hot_bt, s_hbt_s, s_hbt_b, hot_index, s_hi_s, s_hi_h, lru, s_lru_s, s_lru_h,
     out, s_out_r, s_out_c, swap_src, s_ss_q, s_ss_h, swap_dst, s_sd_q, s_sd_h, swap_count,
     s_sc, vc, s_v, hm, s_hm_q, s_hm_c) = common  # fmt: skip
    n = rows * kp
    P = max(1, min(programs, n))
    c = n // P
    bhs = next_pow2(triton.cdiv(H, P))
    cs = (_WAYS << logb) + n
    # Tables (emptied by one fill), then per-entry, per-slot and per-program scratch.
    i32 = torch.empty(Q * (2 * cs + 5 * n + rows + 4 * P + H), dtype=torch.int32, device=dev)
    i16 = torch.empty(Q * H, dtype=torch.int16, device=dev)
    i8 = torch.empty(Q * (H + n), dtype=torch.int8, device=dev)
    i32[: 2 * Q * cs].fill_(-1)
    parts = []
    o = 0
    for size in (Q * cs, Q * cs, Q * n, Q * n, Q * n, Q * n, Q * n, Q * rows, Q * 4 * P, Q * H):
        parts.append(i32[o : o + size])
        o += size
    tab, first, dummy, ent_g, ent_cell, mrank, mg, sc_rows, counts, evict = parts
    hit, head = i8[: Q * H], i8[Q * H :]
    grid = (Q, P)
    nw = 4
    _split_entries_kernel[grid](
        topk, stk_r, stk_c, row_req, R, state, Q,
        src_bt, s_src_q, s_src_b, res_bt, s_res_q, s_res_b,
        out, s_out_r, s_out_c, swap_count, s_sc, vc, s_v, hm, s_hm_q, s_hm_c,
        tab, first, dummy, sc_rows, ent_g, ent_cell, K, block_size, swap_count.shape[0],
        hm.shape[0] if flags["HAS_HM"] else 0,
        ROWS=rows, KP=kp, LOGB=logb, C=c, BR=256, num_warps=nw, **flags,
    )  # fmt: skip
    _split_hits_kernel[grid](
        state, hot_index, s_hi_s, s_hi_h, tab, hit, counts, H,
        N=n, LOGB=logb, BHS=bhs, P=P, num_warps=nw,
    )  # fmt: skip
    _split_count_kernel[grid](
        state, lru, s_lru_s, s_lru_h, tab, first, ent_cell, head, hit, counts, H,
        N=n, LOGB=logb, C=c, BHS=bhs, P=P, num_warps=nw,
    )  # fmt: skip
    _split_rank_kernel[grid](
        state, lru, s_lru_s, s_lru_h, swap_count, s_sc, hm, s_hm_q, s_hm_c,
        ent_g, head, mrank, mg, hit, counts, evict, i16, H, totals, n_layers,
        N=n, C=c, BHS=bhs, P=P, HAS_HM=flags["HAS_HM"], HAS_TOTALS=has_totals, num_warps=nw,
    )  # fmt: skip
    _split_place_kernel[grid](
        state, hot_bt, s_hbt_s, s_hbt_b, hot_index, s_hi_s, s_hi_h,
        lru, s_lru_s, s_lru_h, out, s_out_r, s_out_c,
        swap_src, s_ss_q, s_ss_h, swap_dst, s_sd_q, s_sd_h, swap_count, s_sc,
        tab, first, sc_rows, ent_g, ent_cell, mrank, mg, evict, i16, H, block_size,
        ROWS=rows, KP=kp, LOGB=logb, C=c, BHS=bhs, P=P, S=SPLIT_RANK_TILE, num_warps=nw,
    )  # fmt: skip
