"""numba-compiled forms of the CPU hot spots (optional: numpy/torch without it).

A batch-1 decode step on the CPU runs every data-plane op once per layer on a few hundred
entries; as whole-array numpy (`cpu_ops`) each op is dozens of calls of a few microseconds
each, so the call count, not the arithmetic, is the cost. Here each op is one compiled call
over plain loops. The results of the bookkeeping and copies are `cpu_ops`' (hence the
reference's) bit for bit; the floating-point kernels (selection, attention, norm) say where
their sums round differently.

A prefill's selection and attention are per token too (each query its own candidates and
rows): `topk_rows` and `attend_rows_many` run the decode step's per-token code over all the
tokens of a step, as numba parallel loops on torch's thread count (`parts`).

numba is imported lazily, on the first `jit()` call, and only on the CPU paths: the GPU
machine has no numba, and its absence (or ``HISPARSE_CPU_JIT=0``) makes every caller keep its
numpy/torch path. Functions compile on first use (about a second each; ``cache=True`` keeps
the machine code in ``__pycache__`` when that folder is writable, and numba falls back to its
per-user cache folder, or to no cache, when it is not).
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import numpy as np
import torch

_STATE: dict[str, object] = {"enabled": os.environ.get("HISPARSE_CPU_JIT", "1") != "0"}


def jit() -> SimpleNamespace | None:
    """The compiled functions, or ``None`` where numba is missing or ``HISPARSE_CPU_JIT=0``."""
    if not _STATE["enabled"]:
        return None
    if "fns" not in _STATE:
        _STATE["fns"] = _build()
    return _STATE["fns"]  # type: ignore[return-value]


def set_enabled(enabled: bool) -> None:
    """Turn the compiled paths on or off for this process (tests, A/B timing)."""
    _STATE["enabled"] = enabled


def parts() -> int:
    """How many threads a compiled prefill kernel deals its tokens to (numba's parallel
    loop, set here): torch's CPU thread count. numba's OpenMP layer binds to the OpenMP
    runtime torch loaded first (its symbols come first), so the kernels and torch's ops
    take turns on one thread pool rather than two pools competing for the cores."""
    import numba

    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


#: ``range`` in the plain-Python bodies; `_build` puts numba's parallel range in its place.
prange = range


#: Helpers called from compiled functions; those in `_REASSOCIATE` may sum in any order.
_HELPERS = (
    "_argsort_stable",
    "_search",
    "_fp8_encode",
    "_dots",
    "_sum_squares",
    "_exp_shifted",
    "_mark_best",
    "_row_max",
    "_row_sum",
    "_select_row",
    "_fp8_topk_row",
    "_attend_rows",
    "_resolve_row",
)
_REASSOCIATE = ("_dots", "_sum_squares", "_row_sum")
#: `_mark_best`'s buckets: the top 11 bits of a non-negative fp32 (exponent, 3 mantissa bits).
_BUCKETS = 2048


def _build() -> SimpleNamespace | None:
    try:
        import numba
    except ImportError:
        return None

    def compile_(fn, fastmath: set[str] | bool = False, parallel: bool = False):
        if isinstance(fn, numba.core.dispatcher.Dispatcher):  # a helper, compiled above
            return fn
        opts = {"nogil": True, "fastmath": fastmath, "parallel": parallel}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumbaWarning when no cache folder is writable
            try:
                return numba.njit(cache=True, **opts)(fn)
            except Exception:  # pragma: no cover - no cache locator at all
                return numba.njit(**opts)(fn)

    # Helpers other compiled functions call: compiled first, in place of the module's
    # Python functions (numba resolves a callee from the module's globals at compile time).
    module = globals()
    module["prange"] = numba.prange
    for name in _HELPERS:
        reassociate = {"reassoc", "contract"} if name in _REASSOCIATE else False
        module[name] = compile_(module[name], reassociate)
    return SimpleNamespace(
        resolve_row=compile_(_resolve_row),
        copy_rows=compile_(_copy_rows),
        resolve_decode_row=compile_(_resolve_decode_row),
        fp8_topk_row=compile_(_fp8_topk_row),
        gather_rows=compile_(_gather_rows),
        decode_pre=compile_(_decode_pre),
        attend_rows=compile_(_attend_rows),
        attend_rows_many=compile_(_attend_rows_many, parallel=True),
        topk_rows=compile_(_topk_rows, parallel=True),
        resident_rows=compile_(_resident_rows),
        write_rows_many=compile_(_write_rows_many),
        dense_rows=compile_(_dense_rows),
        is_causal_prefix=compile_(_is_causal_prefix),
        add_rms_norm=compile_(_add_rms_norm),
        fp8_encode=compile_(_fp8_encode),
        finish_decode_row=compile_(_finish_decode_row),
    )


# ---------------------------------------------------------------------------------------------
# Plain-Python bodies (numba compiles them; they also run uncompiled, slowly, for debugging)
# ---------------------------------------------------------------------------------------------
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
    """`cpu_ops.resolve_residency` of one query row of one request (a batch-1 decode step).

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


def _fp8_encode(x, codes, f, u):
    """``codes[i]`` = the e4m3fn byte of fp32 ``x[i]`` clamped to [-448, 448], as torch's
    ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` (round to nearest even, NaN -> 0x7F with
    its sign: c10's ``fp8e4m3fn_from_fp32_value``; tests compare millions of values).
    ``f`` fp32 scratch as long as ``x``, ``u`` the same memory as uint32."""
    n = x.shape[0]
    for i in range(n):
        v = x[i]
        if v > 448.0:
            v = np.float32(448.0)
        elif v < -448.0:
            v = np.float32(-448.0)
        f[i] = v
    for i in range(n):
        fb = np.int64(u[i])
        sign = fb & 0x80000000
        fb = fb ^ sign
        if fb >= (1087 << 20):
            r = np.int64(0x7F)
        elif fb < (121 << 23):
            u[i] = np.uint32(fb)
            f[i] = f[i] + np.float32(16384.0)  # 2^14: the float whose bits are 141 << 23
            r = np.int64(u[i]) - (141 << 23)
        else:
            odd = (fb >> 20) & 1
            r = ((fb + 0xC407FFFF + odd) & 0xFFFFFFFF) >> 20  # + ((7 - 127) << 23) + 0x7FFFF
        codes[i] = np.uint8((r | (sign >> 24)) & 0xFF)


def _exp_shifted(x, top, scratch):
    """``x[i] = exp(x[i] - top)`` in place (``x <= top``; ``-inf`` -> 0), in two loops the
    compiler vectorises (libm's ``expf`` is one call per value): Cody-Waite reduction to
    ``r`` in [-ln2/2, ln2/2], Cephes' degree-7 polynomial for ``e^r`` (within 2 ulp of
    ``expf``), then ``2^n`` built from its bits (``scratch``, viewed as int32). Arguments
    below -87 (``e^x < 2^-126``) give 0."""
    n = x.shape[0]
    bits = scratch.view(np.int32)
    for i in range(n):
        u = x[i] - top
        v = u if u > np.float32(-87.0) else np.float32(-87.0)
        k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
        r = v - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[i] = p * r * r + r + np.float32(1.0)
        bits[i] = ((np.int32(k) + np.int32(127)) << 23) if u > np.float32(-87.0) else 0
    for i in range(n):
        x[i] = x[i] * scratch[i]


def _dots(q, key, logit, c, scale):
    """``logit[h, c] = (q[h] · key[h's KV head]) · scale`` for every query head ``h``; summed
    in whatever order vectorises (numba ``fastmath`` reassociation)."""
    G, QH, D = q.shape
    for g in range(G):
        for j in range(QH):
            acc = np.float32(0.0)
            for d in range(D):
                acc += q[g, j, d] * key[g * D + d]
            logit[g * QH + j, c] = acc * scale


def _fp8_topk_row(q, pflat, play, table, lut, length, pos, sink, window, top_k, scale, out):
    """The batch-1 decode selection of `gqa_indexer_topk` (``fp8`` keys) in one pass.

    ``q [G, H/G, D]`` fp32 (query heads grouped by KV head); the index pages (e4m3 codes,
    ``G·D`` per token) as `paged` gives them (``pflat``, ``play``), read through the
    request's block-table row ``table``; ``lut`` the 256 code
    values (torch's own e4m3 -> fp32, so the keys are exact); ``length`` keys, the query
    at ``pos``.

    The rule is `select_topk`'s: a key's score is its attention mass summed over the query
    heads (softmax of ``q·k·scale`` over the candidates: causal, neither among the first
    ``sink`` nor in the last ``window`` positions); the forced sink and window positions come
    first, then the candidates of highest mass (ties: the earlier position), ``min(top_k,
    length)`` in all, written ascending to ``out``. Each dot product is summed in the order
    the compiler vectorises (`_dots`), the mass as ``exp(l - max) / sum``: the rounding
    differs from torch's einsum and softmax in the last bits (ties at the top-k border may
    then fall the other way; the rule is the same).

    Returns False (``out`` untouched) where not every query has a candidate and at least
    ``min(top_k, length)`` causal keys (`SelectionMasks.full` fails): the caller's general
    path pads and guards those.
    """
    G, QH, D = q.shape
    H = G * QH
    kk = min(top_k, length)
    n_causal = min(pos + 1, length)
    hi = min(pos - window, length - 1)  # candidates: sink <= s <= hi
    if n_causal < kk or hi < sink:
        return False
    n_cand = hi - sink + 1
    n_forced = n_causal - n_cand
    if n_forced > kk:
        return False
    rb = G * D
    off, s_blk, s_row, bs = play[0], play[1], play[2], play[3]
    logit = np.empty((H, n_cand), np.float32)
    key = np.empty(rb, np.float32)
    for c in range(n_cand):
        s = sink + c
        blk = s // bs
        at = off + np.int64(table[blk]) * s_blk + (s - blk * bs) * s_row
        for i in range(rb):
            key[i] = lut[pflat[at + i]]
        _dots(q, key, logit, c, scale)
    mass = np.empty(n_cand, np.float32)
    scratch = np.empty(n_cand, np.float32)
    keep = np.empty(n_cand, np.bool_)
    hist = np.empty(_BUCKETS, np.int64)
    _select_row(logit.reshape((G, 1, QH, n_cand)), 0, n_cand, n_causal, sink, hi,
                kk - n_forced, mass, scratch, keep, hist, out)  # fmt: skip
    return True


def _mark_best(mass, n, m, keep, hist, pool):
    """``keep[c]`` True for the ``m`` highest of ``mass[:n]`` (finite, ``>= 0``), the earlier
    index on ties (the first ``m`` of a stable argsort of ``-mass``), False elsewhere.

    A radix select instead of a sort (which cost more than the scoring in a prefill): the
    bits of a non-negative float order like the float, so one pass counts the values per
    top-11-bit bucket (``hist``: 2048 int64), the bucket holding the ``m``-th largest is
    found from the top, and only its members (copied to ``pool``, fp32 ``>= n``) are
    partitioned for the exact value ``v``; then ``mass > v`` and the first ties ``== v``."""
    for c in range(n):
        keep[c] = False
    if m <= 0:
        return
    if m >= n:
        for c in range(n):
            keep[c] = True
        return
    bits = mass.view(np.int32)
    for b in range(hist.shape[0]):
        hist[b] = 0
    b = 0  # the highest bucket in use: the scan starts there
    for c in range(n):
        bucket = (bits[c] >> 20) & (_BUCKETS - 1)  # (the mask only guards memory: NaN)
        hist[bucket] += 1
        b = max(b, bucket)
    above = 0
    while above + hist[b] < m:
        above += hist[b]
        b -= 1
    k = 0
    for c in range(n):
        if ((bits[c] >> 20) & (_BUCKETS - 1)) == b:
            pool[k] = mass[c]
            k += 1
    r = m - above  # the r-th largest member of bucket b is the m-th largest overall
    v = np.partition(pool[:k], k - r)[k - r]
    need = m
    for c in range(n):
        if mass[c] > v:
            keep[c] = True
            need -= 1
    for c in range(n):
        if need == 0:
            break
        if mass[c] == v:
            keep[c] = True
            need -= 1


def _row_max(x, n):
    """``max(x[:n])`` (``n >= 1``, no NaN) over 16 lanes, which the compiler vectorises (a
    running maximum does not; the maximum is exact in any order)."""
    lanes = np.empty(16, np.float32)
    for lane in range(16):
        lanes[lane] = x[0]
    full = n - n % 16
    for i in range(0, full, 16):
        for lane in range(16):
            v = x[i + lane]
            lanes[lane] = v if v > lanes[lane] else lanes[lane]
    top = lanes[0]
    for lane in range(1, 16):
        if lanes[lane] > top:
            top = lanes[lane]
    for i in range(full, n):
        if x[i] > top:
            top = x[i]
    return top


def _row_sum(x, n):
    """``Σ x[:n]`` in fp32, summed in whatever order vectorises (``fastmath`` reassociation)."""
    acc = np.float32(0.0)
    for i in range(n):
        acc += x[i]
    return acc


def _select_row(lg, t, n_cand, n_causal, sink, hi, m, mass, scratch, keep, hist, out):
    """`select_topk`'s rule for query ``t`` from its candidates' logits ``lg[:, t]`` of
    ``lg [G, T, H/G, >= n_cand]`` (positions ``sink .. hi``, overwritten; C-contiguous: a
    row of a non-contiguous view does not vectorise): per query head a softmax over the
    candidates, each candidate's mass summed over the heads (``exp(l - max) / sum``), the
    ``m`` best candidates (`_mark_best`) and every forced position (the first ``sink``, and
    ``hi + 1 .. n_causal - 1``) written ascending to ``out``, ``-1`` after them. Each sum
    runs in the order that vectorises. ``mass``, ``scratch`` (fp32) and ``keep`` (bool):
    scratch of at least ``n_cand``; ``hist``: `_mark_best`'s."""
    G, QH = lg.shape[0], lg.shape[2]
    for g in range(G):
        for j in range(QH):
            row = lg[g, t, j, :n_cand]
            _exp_shifted(row, _row_max(row, n_cand), scratch)
            inv = np.float32(1.0) / _row_sum(row, n_cand)
            if g == 0 and j == 0:
                for c in range(n_cand):
                    mass[c] = row[c] * inv
            else:
                for c in range(n_cand):
                    mass[c] += row[c] * inv
    _mark_best(mass, n_cand, m, keep, hist, scratch)
    n = 0
    for s in range(n_causal):
        if s < sink or s > hi or keep[s - sink]:
            out[n] = s
            n += 1
    for i in range(n, out.shape[0]):
        out[i] = -1


def _topk_rows(logits, positions, length, sink, window, top_k, out, parts):
    """`_select_row` for each scored query of one request (a prefill): ``logits [G, T, H/G,
    S]`` of the candidates ``s = sink + c`` (overwritten), the queries at ``positions [T]``,
    ``length`` keys; rows ``out [T, >= min(top_k, length)]``. The queries are dealt
    round-robin to ``parts`` threads (`_parts`). Returns False (rows left unwritten) for a
    query that is not scored (fewer than ``min(top_k, length)`` causal keys, no candidate,
    more candidates than columns); the caller checks beforehand."""
    T, S = logits.shape[1], logits.shape[3]
    kk = min(top_k, length)
    ok = np.ones(parts, np.bool_)
    for part in prange(parts):
        mass = np.empty(S, np.float32)
        scratch = np.empty(S, np.float32)
        keep = np.empty(S, np.bool_)
        hist = np.empty(_BUCKETS, np.int64)
        for t in range(part, T, parts):
            pos = np.int64(positions[t])
            n_causal = min(pos + 1, length)
            hi = min(pos - window, length - 1)
            n_cand = hi - sink + 1
            if n_causal < kk or n_cand < 1 or n_cand > S or n_causal - n_cand > kk:
                ok[part] = False
                continue
            _select_row(logits, t, n_cand, n_causal, sink, hi, kk - (n_causal - n_cand),
                        mass, scratch, keep, hist, out[t])  # fmt: skip
    return ok.all()


def _dense_rows(positions, req, lens, top_k, out, scored):
    """A prefill's selections before scoring: ``scored[t]`` whether token ``t`` is scored
    (its request ``req[t]`` holds more than ``top_k >= 0`` keys and it sits at position
    ``top_k`` or later); every other token's row of ``out`` is `dense_topk`'s (positions
    ``0 .. p``, then ``-1``; all ``-1`` for padding, ``req < 0``). Scored rows are left to
    the scoring."""
    n, w = out.shape
    for t in range(n):
        r = np.int64(req[t])
        p = np.int64(positions[t])
        scored[t] = r >= 0 and 0 <= top_k < lens[r] and p >= top_k
        if scored[t]:
            continue
        last = p if r >= 0 else -1
        for j in range(w):
            out[t, j] = j if j <= last else -1


def _write_rows_many(k, v, kflat, klay, k_blocks, slots, wflat, wlay, w_blocks, islots):
    """A prefill step's writes: for each token ``t``, the row ``[k ‖ v]`` (fp32) at
    physical row ``slots[t]`` of the paged rows ``kflat``/``klay`` and the fp8 index key
    (`_fp8_encode`, torch's bytes) at row ``islots[t]`` of the index pages
    ``wflat``/``wlay`` (``< 0``: skipped; ``k_blocks``, ``w_blocks``: the views' block
    counts); ``k``, ``v`` ``[T, G, D]`` (any strides). What `write_rows_fast` and
    `write_index_keys` write, in one call instead of a dozen torch ops. Returns False
    (nothing written) for a row past its view."""
    n, G, D = k.shape
    GD = G * D
    for t in range(n):
        s = np.int64(slots[t])
        i = np.int64(islots[t])
        if s >= k_blocks * klay[3] or i >= w_blocks * wlay[3]:
            return False
    key = np.empty(GD, np.float32)
    codes = np.empty(GD, np.uint8)
    scratch = np.empty(GD, np.float32)
    bits = scratch.view(np.uint32)
    for t in range(n):
        for g in range(G):
            for d in range(D):
                key[g * D + d] = k[t, g, d]
        s = np.int64(slots[t])
        if s >= 0:
            b = s // klay[3]
            at = klay[0] + b * klay[1] + (s - b * klay[3]) * klay[2]
            for c in range(GD):
                kflat[at + c] = key[c]
            for g in range(G):
                for d in range(D):
                    kflat[at + GD + g * D + d] = v[t, g, d]
        i = np.int64(islots[t])
        if i >= 0:
            _fp8_encode(key, codes, scratch, bits)
            b = i // wlay[3]
            at = wlay[0] + b * wlay[1] + (i - b * wlay[3]) * wlay[2]
            for c in range(GD):
                wflat[at + c] = codes[c]
    return True


def _decode_pre(
    qkv, cos, sin, n_heads, q_out, kflat, klay, slot, wflat, wlay, islot, codes, scratch,
    scratch_bits, rflat, rlay, table, lut, length, pos, sink, window, top_k, scale, scored,
    out,
):  # fmt: skip
    """A GQA layer's batch-1 decode step from its q/k/v projections up to the swap-in.

    ``qkv`` the projected token (q heads, k heads, v heads; ``D`` each); ``cos``, ``sin`` its
    `full_width_rope` tables ``[D]``. Writes the rotated queries to ``q_out [H, D]``, the
    row ``[k ‖ v]`` (fp32) at physical row ``slot`` of the paged rows ``kflat``/``klay`` and
    the fp8 key (`_fp8_encode`) at row ``islot`` of the index pages ``wflat``/``wlay``
    (``< 0``: skipped), then the logical top-k into ``out``: the `_fp8_topk_row` selection
    over ``rflat``/``rlay``/``table`` when ``scored``, else every position up to ``pos``.
    (Paged arrays as `paged` describes them.)

    The rotation is `rope_full_width`'s ``x·c + roll(x)·s`` with each product and the sum
    rounded alone (no fused multiply-add), so every written value is torch's bit for bit.
    Returns False when the scored selection does not apply (the caller selects instead).
    """
    D = cos.shape[0]
    half = D // 2
    H = n_heads
    GD = codes.shape[0]
    G = GD // D
    k_rot = np.empty(GD, np.float32)
    for h in range(H + G):
        base = h * D
        for i in range(D):
            j = i + half if i < half else i - half
            y = qkv[base + i] * cos[i] + qkv[base + j] * sin[i]
            if h < H:
                q_out[h, i] = y
            else:
                k_rot[(h - H) * D + i] = y
    if slot >= 0:
        b = slot // klay[3]
        at = klay[0] + b * klay[1] + (slot - b * klay[3]) * klay[2]
        for i in range(GD):
            kflat[at + i] = k_rot[i]
            kflat[at + GD + i] = qkv[(H + G) * D + i]
    if islot >= 0:
        _fp8_encode(k_rot, codes, scratch, scratch_bits)
        b = islot // wlay[3]
        at = wlay[0] + b * wlay[1] + (islot - b * wlay[3]) * wlay[2]
        for i in range(GD):
            wflat[at + i] = codes[i]
    if scored:
        return _fp8_topk_row(
            q_out.reshape((G, H // G, D)), rflat, rlay, table, lut, length, pos, sink, window,
            top_k, scale, out,
        )  # fmt: skip
    for s in range(out.shape[0]):
        out[s] = s if s <= pos else -1
    return True


def _attend_rows(q, kflat, klay, rows, scale, out):
    """``out [H, D]``: attention of the query heads ``q [H, D]`` over the rows ``rows`` of
    the paged rows ``kflat``/``klay`` (``[k ‖ v]`` fp32, ``2·G·D`` per row, read in place;
    ``< 0``: masked), query head ``h`` on KV head ``h // (H / G)``; a head with no valid row
    gets 0. Scores as `_dots` sums them, then ``Σ exp(s - max) · v / Σ exp(s - max)``
    (the sums vectorised): `sparse_gqa_reference`'s math, rounded differently in the last
    bits. Masked entries after the last valid one (a selection's padding) are skipped."""
    H, D = q.shape
    GD = klay[4] // 2
    G = GD // D
    QH = H // G
    K = rows.shape[0]
    while K > 0 and rows[K - 1] < 0:
        K -= 1
    if K == 0:
        for h in range(H):
            for d in range(D):
                out[h, d] = 0.0
        return
    off, s_blk, s_row, bs = klay[0], klay[1], klay[2], klay[3]
    qg = q.reshape((G, QH, D))
    scores = np.empty((H, K), np.float32)
    scale2 = np.empty(K, np.float32)
    starts = np.empty(K, np.int64)
    for k in range(K):
        r = np.int64(rows[k])
        if r < 0:
            starts[k] = -1
            for h in range(H):
                scores[h, k] = -np.inf
            continue
        b = r // bs
        at = off + b * s_blk + (r - b * bs) * s_row
        starts[k] = at
        _dots(qg, kflat[at : at + GD], scores, k, scale)
    for h in range(H):
        srow = scores[h]
        _exp_shifted(srow, _row_max(srow, K), scale2)  # row K - 1 is valid: a finite max
        inv = np.float32(1.0) / _row_sum(srow, K)
        for k in range(K):
            srow[k] = srow[k] * inv
        for d in range(D):
            out[h, d] = 0.0
    for k in range(K):
        at = starts[k]
        if at < 0:
            continue
        for g in range(G):
            v = kflat[at + GD + g * D : at + GD + (g + 1) * D]
            for j in range(QH):
                h = g * QH + j
                p = scores[h, k]
                o = out[h]
                for d in range(D):
                    o[d] += p * v[d]


def _attend_rows_many(q, kflat, klay, rows, scale, out, parts):
    """`_attend_rows` of every token of ``q [T, H, D]``, each over its own rows
    ``rows [T, K]`` (a prefill's per-token selections), into ``out [T, H, D]``; the tokens
    dealt round-robin to ``parts`` threads (`_parts`)."""
    T = q.shape[0]
    for part in prange(parts):
        for t in range(part, T, parts):
            _attend_rows(q[t], kflat, klay, rows[t], scale, out[t])


def _is_causal_prefix(rows, positions, ref):
    """Whether each token ``t`` attends to exactly ``ref[: positions[t] + 1]``, in that
    order (``rows[t]`` those, then only ``-1``): a dense causal prefix of the rows
    ``ref`` of positions ``0, 1, ...``."""
    n, k = rows.shape
    for t in range(n):
        p = np.int64(positions[t])
        if p < 0 or p >= ref.shape[0] or p >= k:
            return False
        for j in range(p + 1):
            if rows[t, j] != ref[j] or ref[j] < 0:
                return False
        for j in range(p + 1, k):
            if rows[t, j] >= 0:
                return False
    return True


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


#: Whole storages as flat numpy arrays, by (address, bytes, item type); bounded (an entry
#: keeps its storage alive, so no other storage can take its address while it is here).
_FLAT: dict[tuple[int, int, str], np.ndarray] = {}
_FLAT_MAX = 256


def _flat(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    st = t.untyped_storage()
    key = (st.data_ptr(), st.nbytes(), dtype.str)
    arr = _FLAT.get(key)
    if arr is None:
        whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
        arr = whole[: st.nbytes() - st.nbytes() % dtype.itemsize].numpy().view(dtype)
        if len(_FLAT) >= _FLAT_MAX:
            _FLAT.pop(next(iter(_FLAT)))
        _FLAT[key] = arr
    return arr


#: `paged_rows` / `paged_pages` results by tensor identity (the per-layer views persist
#: across steps); an entry keeps its tensor alive, so its id cannot be reused meanwhile.
_PAGED: dict[tuple[int, str, int], tuple[torch.Tensor, object]] = {}


def _remembered(key: tuple[int, str, int], t: torch.Tensor, make):
    hit = _PAGED.get(key)
    if hit is not None and hit[0] is t:
        return hit[1]
    value = make()
    if len(_PAGED) >= _FLAT_MAX:
        _PAGED.pop(next(iter(_PAGED)))
    _PAGED[key] = (t, value)
    return value


def paged_rows(view: torch.Tensor, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """`_paged_rows`, remembered per view (tensors whose shape, strides and storage never
    change after creation, as the caches' views)."""
    return _remembered((id(view), dtype.str, 0), view, lambda: _paged_rows(view, dtype))


def paged_pages(pages: torch.Tensor, row_bytes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`_paged_pages`, remembered per pages tensor."""
    return _remembered((id(pages), "pages", row_bytes), pages,
                       lambda: _paged_pages(pages, row_bytes))  # fmt: skip


def _paged_rows(view: torch.Tensor, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """``(flat, layout)`` of paged rows ``view [blocks, bs, row bytes]`` (uint8) for the
    compiled functions: ``flat`` the whole storage as a 1-D ``dtype`` numpy array (shared
    memory; contiguous, so loops over a row vectorise whatever the pool's strides),
    ``layout`` int64 ``[offset, block stride, row stride, block size, row width]`` in items.
    ``None`` where the strides are not whole items."""
    size = dtype.itemsize
    if view.dim() != 3 or view.dtype != torch.uint8 or view.stride(2) != 1:
        return None
    if view.storage_offset() % size or any(st % size for st in view.stride()[:2]):
        return None
    if view.shape[2] % size:
        return None
    _, bs, width = view.shape
    layout = np.array(
        [view.storage_offset() // size, view.stride(0) // size, view.stride(1) // size, bs,
         width // size], dtype=np.int64,
    )  # fmt: skip
    return _flat(view, dtype), layout


def _paged_pages(pages: torch.Tensor, row_bytes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`_paged_rows` of index pages ``[blocks, bs · row_bytes]`` (uint8 items)."""
    if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.stride(1) != 1:
        return None
    if pages.shape[1] % row_bytes:
        return None
    return _paged_rows(pages.unflatten(1, (pages.shape[1] // row_bytes, row_bytes)), _U8)


_U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)


def _sum_squares(x):
    """``Σ x²`` in fp32, summed in whatever order vectorises (``fastmath`` reassociation)."""
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * x[i]
    return acc


def _add_rms_norm(x, delta, add, weight, eps, x_out, h_out):
    """``x_out = x + delta`` (``add`` False: ``x``), ``h_out = weight · (x_out · r)`` with
    ``r = 1 / sqrt(mean(x_out²) + eps)``: a residual add and the RMS norm after it
    (`RMSNorm`'s steps in fp32; the add is exact, the sum of squares rounds in another
    order than torch's mean, so the norm may differ from torch's in the last bits)."""
    n = x.shape[0]
    for i in range(n):
        x_out[i] = x[i] + delta[i] if add else x[i]
    r = np.float32(1.0) / np.sqrt(_sum_squares(x_out) / np.float32(n) + eps)
    for i in range(n):
        h_out[i] = weight[i] * (x_out[i] * r)
