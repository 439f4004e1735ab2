"""Compiled layer kernels of a batch-1 step: row and index-key writes, the step's rotary,
writes and selection in one call, attention read in place from the pool, and the residual add
with the RMS norm after it (plain-Python bodies; `compile.build` compiles them with numba).
The floating-point kernels say where their sums round differently from torch's.
"""

from __future__ import annotations

import numpy as np

from hisparse.runtime.ops.cpu.selection_kernels import (
    _dots,
    _exp_shifted,
    _fp8_topk_row,
    _row_max,
    _row_sum,
)

#: ``range`` in the plain-Python bodies; `compile.build` puts numba's parallel range in its place.
prange = range


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
