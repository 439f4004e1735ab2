"""Compiled selection kernels: the GQA indexer's per-query top-k (fp8 scoring, the exact
k-th largest mass, sink and recent window) for a decode row and for a prefill's tokens
(plain-Python bodies; `compile.build` compiles them with numba).
"""

from __future__ import annotations

import numpy as np

#: ``range`` in the plain-Python bodies; `compile.build` puts numba's parallel range in its place.
prange = range

#: `_mark_best`'s buckets: the top 11 bits of a non-negative fp32 (exponent, 3 mantissa bits).
_BUCKETS = 2048


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
