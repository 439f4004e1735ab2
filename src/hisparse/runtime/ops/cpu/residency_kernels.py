"""Compiled residency kernels: a batch-1 step's resolve, its row copies, and a prefill's
resident-row lookup (plain-Python bodies; `compile.build` compiles them with numba, and they
run uncompiled, slowly, for debugging). Their results equal `ops`' (hence the reference's)
bit for bit.
"""

from __future__ import annotations

import numpy as np


def _argsort_stable(keys):
    """Indices that sort ``keys`` ascending, equal keys in index order (numpy's stable
    argsort; a bottom-up merge sort here: plain loops compile in a fraction of the time
    numba needs for ``np.argsort``)."""
    n = keys.shape[0]
    a = np.arange(n)
    b = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if keys[a[j]] < keys[a[i]]:
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < hi:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    return a


def _search(keys, n, v):
    """The first index ``i < n`` with ``keys[i] >= v`` (``keys[:n]`` ascending), else ``n``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _resolve_row(pos, src_bt, res_bt, has_res, hot_bt, hot, lru, bs, out, swap_src, swap_dst):
    """`ops.resolve_residency` of one query row of one request (a batch-1 decode step).

    ``pos [K]`` logical positions (``< 0``: none); ``src_bt`` / ``res_bt`` the request's host
    and resident block-table rows (``res_bt`` read only with ``has_res``); ``hot_bt``, ``hot``,
    ``lru`` its state slot's hot block table, held rows and LRU order (updated in place);
    ``out [K]`` the physical rows; ``swap_src`` / ``swap_dst`` its swap-list rows.

    Returns ``(ok, valid, wanted, misses)``. ``ok`` False (nothing written): an input the
    reference rejects (a position past the block table, a negative host row, more wanted rows
    than hot slots) or an invalid hot state; the caller hands the step to the reference.
    """
    K = pos.shape[0]
    NB = src_bt.shape[0]
    H = hot.shape[0]
    phys = np.empty(K, np.int64)
    ent = np.empty(K, np.int64)  # entries that need the hot buffer, in entry order
    host = np.empty(K, np.int64)  # their host rows
    n_valid = 0
    n_ent = 0
    for i in range(K):
        p = np.int64(pos[i])
        phys[i] = -1
        if p < 0:
            continue
        n_valid += 1
        b = p // bs
        o = p - b * bs
        if b >= NB:
            return False, 0, 0, 0
        if has_res:
            rb = np.int64(res_bt[b])
            if rb != 0:
                phys[i] = rb * bs + o
                continue
        g = np.int64(src_bt[b]) * bs + o
        if g < 0:
            return False, 0, 0, 0
        ent[n_ent] = i
        host[n_ent] = g
        n_ent += 1
    if n_ent == 0:
        for i in range(K):
            out[i] = phys[i]
        return True, n_valid, 0, 0
    # Wanted set: distinct host rows, sorted (the swap list's order), each one's first entry.
    order = _argsort_stable(host[:n_ent])
    keys = np.empty(n_ent, np.int64)
    first = np.empty(n_ent, np.int64)
    inverse = np.empty(n_ent, np.int64)
    U = 0
    for j in range(n_ent):
        e = order[j]
        g = host[e]
        if U == 0 or keys[U - 1] != g:
            keys[U] = g
            first[U] = e
            U += 1
        inverse[e] = U - 1
    if U > H:
        return False, 0, 0, 0
    # Hits: slots holding a wanted row.
    slot_of_u = np.full(U, -1, np.int64)
    hit_slot = np.zeros(H, np.bool_)
    n_hit = 0
    for h in range(H):
        v = np.int64(hot[h])
        if v < 0:
            continue
        at = _search(keys, U, v)
        if at < U and keys[at] == v:
            if slot_of_u[at] >= 0:  # two slots hold one row: not a valid hot state
                return False, 0, 0, 0
            slot_of_u[at] = h
            hit_slot[h] = True
            n_hit += 1
    n_miss = U - n_hit
    # New LRU order: evictable slots past the misses, the slots just filled, then the hits.
    evict = np.empty(H, np.int64)
    hits = np.empty(H, np.int64)
    n_ev = 0
    n_h = 0
    for j in range(H):
        sl = np.int64(lru[j])
        if hit_slot[sl]:
            hits[n_h] = sl
            n_h += 1
        else:
            evict[n_ev] = sl
            n_ev += 1
    if n_ev < n_miss or n_h != n_hit:
        return False, 0, 0, 0
    # Misses in wanted-set order (first entry) take the oldest evictable slots.
    miss_u = np.empty(n_miss, np.int64)
    miss_first = np.empty(n_miss, np.int64)
    m = 0
    for u in range(U):
        if slot_of_u[u] < 0:
            miss_u[m] = u
            miss_first[m] = first[u]
            m += 1
    by_first = _argsort_stable(miss_first)
    for m in range(n_miss):
        slot_of_u[miss_u[by_first[m]]] = evict[m]
    j = 0
    for m in range(n_miss, n_ev):
        lru[j] = evict[m]
        j += 1
    for m in range(n_miss):
        lru[j] = evict[m]
        j += 1
    for m in range(n_h):
        lru[j] = hits[m]
        j += 1
    for m in range(n_miss):
        u = miss_u[m]
        hot[slot_of_u[u]] = keys[u]
    phys_of_u = np.empty(U, np.int64)
    for u in range(U):
        sl = slot_of_u[u]
        blk = sl // bs
        phys_of_u[u] = np.int64(hot_bt[blk]) * bs + (sl - blk * bs)
    for e in range(n_ent):
        phys[ent[e]] = phys_of_u[inverse[e]]
    for i in range(K):
        out[i] = phys[i]
    for m in range(n_miss):
        u = miss_u[m]
        swap_src[m] = keys[u]
        swap_dst[m] = phys_of_u[u]
    return True, n_valid, U, n_miss


def _resolve_decode_row(
    pos, src_bt, res_bt, has_res, hot_bt, hot, lru, bs, out, swap_src, swap_dst, q,
    valid_counts, swap_count, hit_miss, totals, n_layers,
):  # fmt: skip
    """`_resolve_row` for request ``q`` (the only query row of a decode step) plus the
    runtime's bookkeeping: ``valid_counts[0]``, every request's swap count and hit/miss
    counters reset, then request ``q``'s set, and the running ``totals`` (hits, misses,
    rows moved = misses x ``n_layers``). Returns the misses, or -1 (nothing written) where
    `_resolve_row` declines."""
    ok, n_valid, wanted, n_miss = _resolve_row(
        pos, src_bt, res_bt, has_res, hot_bt, hot, lru, bs, out, swap_src[q], swap_dst[q]
    )
    if not ok:
        return -1
    valid_counts[0] = n_valid
    swap_count[:] = 0
    hit_miss[:] = 0
    swap_count[q] = n_miss
    hit_miss[q, 0] = wanted - n_miss
    hit_miss[q, 1] = n_miss
    totals[0] += wanted - n_miss
    totals[1] += n_miss
    totals[2] += n_miss * n_layers
    return n_miss


def _copy_rows(src, dst, src_rows, dst_rows, n):
    """``dst`` row ``dst_rows[i]`` = ``src`` row ``src_rows[i]`` for ``i < n``; ``src`` and
    ``dst`` are paged ``[blocks, block_size, width]`` (any strides, distinct memory)."""
    sbs = src.shape[1]
    dbs = dst.shape[1]
    w = src.shape[2]
    for i in range(n):
        s = np.int64(src_rows[i])
        d = np.int64(dst_rows[i])
        sb = s // sbs
        db = d // dbs
        a = src[sb, s - sb * sbs]
        b = dst[db, d - db * dbs]
        for c in range(w):
            b[c] = a[c]


def _finish_decode_row(hot, drop, s, row, src, dst, src_row, dst_row, copy):
    """A batch-1 decode step's KV update bookkeeping for one layer: with ``drop``, empty
    (-1) every slot of ``hot[s]`` holding host row ``row`` (`invalidate_written_slots`);
    with ``copy``, ``dst`` row ``dst_row`` = ``src`` row ``src_row`` (the host mirror,
    `gather_plan`; paged ``[blocks, block_size, width]``, any strides). The caller checks
    the indices."""
    if drop:
        held = hot[s]
        for h in range(held.shape[0]):
            if held[h] == row:
                held[h] = -1
    if copy:
        sbs = src.shape[1]
        dbs = dst.shape[1]
        r = np.int64(src_row)
        d = np.int64(dst_row)
        sb = r // sbs
        db = d // dbs
        a = src[sb, r - sb * sbs]
        b = dst[db, d - db * dbs]
        for c in range(src.shape[2]):
            b[c] = a[c]


def _gather_rows(src, rows, out):
    """``out[i] = src`` row ``rows[i]`` (``src`` paged ``[blocks, block_size, W]``, any
    strides; ``out [n, W]``)."""
    bs = src.shape[1]
    w = src.shape[2]
    for i in range(rows.shape[0]):
        r = np.int64(rows[i])
        b = r // bs
        a = src[b, r - b * bs]
        o = out[i]
        for c in range(w):
            o[c] = a[c]


def _resident_rows(topk, req, table, bs, out):
    """`CacheHandle.resident_rows` of a prefill step: ``out[i, j]`` = the resident row of
    logical position ``topk[i, j]`` of request ``req[i]`` through ``table`` (``[R, blocks]``,
    0: not resident), ``-1`` where the entry or the token is padding. Returns False (the
    caller raises) when a live entry lies past the table or on a page that is not
    resident."""
    n, k = topk.shape
    nb = table.shape[1]
    for i in range(n):
        r = np.int64(req[i])
        for j in range(k):
            p = np.int64(topk[i, j])
            if p < 0 or r < 0:
                out[i, j] = -1
                continue
            b = p // bs
            if b >= nb:
                return False
            blk = np.int64(table[r, b])
            if blk <= 0:
                return False
            out[i, j] = blk * bs + p - b * bs
    return True
