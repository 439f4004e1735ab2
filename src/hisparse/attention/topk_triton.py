"""Exact top-k of score rows by radix select in Triton launches, for the lightning indexer.

`topk_select_reference` is the contract: per row the ``k`` largest finite scores (``-inf`` and
NaN never picked; with fewer than ``k`` finite scores, all of them), ties at the k-th value
going to the lowest positions, written in ascending position order and ``-1`` padded.
``torch.topk`` picks the same set wherever the k-th score is not tied (it orders best first
and leaves its tie order unspecified); nothing downstream reads the order of a selection.

Why: ``torch.topk`` over a 128K row runs radix-sort kernels per layer and step (most of them
busy on one row) that take many times as long as reading the row's 512 KB (docs/benchmarks.md
§15). Here a score's
fp32 bits, flipped so that their unsigned order is the float order, are found one byte at a
time over a ``(row, part)`` grid, each program reading a part of the row (`topk_radix`
holds the pieces these launches share with the floor's):

1. three histogram launches: each program adds its part's 256-bin histogram of the next byte,
   among the keys whose higher bytes equal those found so far, to the row's histogram in
   global memory (``tl.histogram``, then an atomic add per bin it has keys in; a block of
   keys of which few share the bytes found so far adds them one atomic each instead, and a
   block of which none do costs no histogram). Every program re-derives the bytes found so
   far from the earlier histograms (a 256-bin scan each), so no launch is spent on scans;
2. the last byte's launch: the same histogram of the fourth byte, and besides each part's
   keys above the three bytes found, and its own histogram of the fourth byte as suffix
   sums (so that a later program reads any part's keys above or equal to a fourth byte in
   two loads). Part 0 stores the row's three bytes, the keys still to take and the count
   of finite scores, so the next launch reads only the fourth byte's histogram;
3. a write launch: the exact k-th key and how many keys equal to it to take, each part's
   output offset from prefix sums over the parts before it, then its picks in position
   order (ties: the first ones by position; a block's tie ranks, a prefix sum, only where it
   holds the k-th key, and its write only where it has picks).

**The floor** (decode batches of long rows; `topk_floor` decides when a call takes one and
finds it): two launches before the first histogram find, per row, a floor below which no pick
lies, and the first histogram launch keeps only the keys at or above it, so that the later
launches read a few thousand candidates a row instead of every score:

0. the floor's two launches (`topk_floor`);
1. the first histogram launch stores each part's keys at or above the floor, in position
   order, from the part's first slot on (keys, positions, count), and histograms their first
   byte once it has them all (rather than an atomic a key: a row's candidates share one or
   two bins); the other launches read those instead of the scores, and the write launch writes
   their stored positions. The picks are the same: the floor only removes keys no pick can
   be. Fewer programs per SM (`FLOOR_PROGRAMS_PER_SM`): over candidates a launch's cost is
   each program's fixed part.

The histograms must start at zero. Up to `KEPT_HIST_ROWS` rows (a decode batch) they live in
one buffer per device that is zero at rest but for the last byte's histogram: the write
launch zeroes each row's other histograms (no program of it reads them) and the next
call's first histogram launch zeroes the fourth (which no program of it reads), so a step
needs no fill (larger calls, prefill chunks, get a zeroed buffer of their own). Calls on one
device therefore run one after another on its streams, as the engine's compute stream runs
them.

A histogram costs per key (``tl.histogram``: shared-memory atomics), so a row is spread over
many programs, and the digits stay a byte wide: one program per row, or wider digits with
fewer launches, measured slower on the H200 (docs/benchmarks.md §15).

Launch boundaries are the only barriers (nothing spins), the grid depends on shapes alone and
nothing synchronises with the host, so a decode step captures it in its CUDA graph. Rows may
end early (``limits``: a token's causal limit), so a graph captured at the block table's width
reads only each row's own keys. On Hopper, when the parts are short (`PDL_MAX_PART`), each
launch is a programmatic dependent of the one before (`triton_common.dependent_launch`): it
starts while that one finishes and waits for its writes first, saving the launch gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.attention.topk_floor import (
    GroupMaxima,
    _call_floor_group,
    _floor_byte_kernel,
    _floor_max_kernel,
)
from hisparse.attention.topk_radix import (
    BINS,
    DIGIT_BITS,
    HISTS,
    INT32_MIN,
    _descend,
    _histograms,
    _keys,
    _program,
)
from hisparse.attention.triton_split import num_sms
from hisparse.runtime.ops.triton_common import dependent_launch, grid_dependency_wait

#: Elements one program reads per iteration (fewer, down to `MIN_BLOCK`, in a shorter part).
BLOCK = 2048
MIN_BLOCK = 256
#: Histogram launches a key takes, one per byte.
PASSES = 32 // DIGIT_BITS
#: Keys of a block that share the bytes found so far, up to which the second and third
#: histograms add them one global atomic each instead of a block histogram (``tl.histogram``
#: costs per key of the block, matching or not; after the first byte few keys match):
#: measured faster than a histogram for every block (docs/benchmarks.md §15).
SPARSE_KEYS = 256
#: Fewest elements per program worth a part of its own (at one 128K row, 128 parts of 1,024
#: keys measured faster than 32 of 4,096, docs/benchmarks.md §15; a part's histogram costs
#: per key).
MIN_PART = 1024
#: Programs per SM over a call: each program's histogram waits on its loads and atomics, so an
#: SM needs several (docs/benchmarks.md §15, ``--sweep-parts``: 8 beat 2 at 29 and 64 rows of
#: 128K, equal at 8 rows; at 2, ncu saw a histogram launch keep few of an SM's warps busy).
PROGRAMS_PER_SM = 8
#: Longest part (keys a program reads) whose launches go as programmatic dependents: they
#: save the launch gap, which counts for short programs (1 / 8 rows of 128K and 29 of 32K,
#: 1K-4K keys a part) and costs more than it saves for long ones (29 / 64 rows of 128K;
#: docs/benchmarks.md §15).
PDL_MAX_PART = 4096
#: Programs per SM over a call with the floor: its launches after the first pass read few
#: candidates, so their cost is each program's fixed part (docs/benchmarks.md §15,
#: ``--sweep-parts``: 2 per SM beat 8 at 29 and 64 rows of 128K).
FLOOR_PROGRAMS_PER_SM = 2
#: Group maxima the floor's second launch reads an iteration, at most (docs/benchmarks.md
#: §15, ``--sweep-floor``: 1,024 beat 128 at 29 and 64 rows of 128K).
FLOOR_BYTE_BLOCK = 1024
#: Candidates the launches after the compaction read an iteration, at most: a part keeps a
#: few hundred, and an iteration's scans cost per slot of its block, filled or not.
FLOOR_CAND_BLOCK = 512


def topk_select_reference(scores: Tensor, top_k: int, limits: Tensor | None = None) -> Tensor:
    """The contract (see the module docstring): ``int32 [T, top_k]``, ascending positions,
    ``-1`` padded; row ``t`` reads positions below ``limits[t]`` only, when given."""
    t, s = scores.shape
    x = scores.float().clone()
    x[torch.isnan(x)] = float("-inf")
    if limits is not None:
        pos = torch.arange(s, device=x.device)
        x[pos[None, :] >= limits.to(x.device).long()[:, None]] = float("-inf")
    out = torch.full((t, top_k), -1, dtype=torch.int32, device=scores.device)
    kk = min(top_k, s)
    if t == 0 or kk == 0:
        return out
    # a stable descending sort keeps equal scores in position order: ties go to the lowest
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :kk]
    keep = x.gather(1, order) > float("-inf")
    picks = torch.where(keep, order, s).sort(dim=1).values
    out[:, :kk] = torch.where(picks < s, picks, -1).to(torch.int32)
    return out


@triton.jit
def _candidates(t, part, lo, hi, row, cand, count, S, NPARTS, FLOOR: tl.constexpr):
    """What a launch after the compaction reads (with ``FLOOR``): the part's candidate keys,
    ``[lo, lo + count)`` of the row's candidate buffer; else the part's scores."""
    if FLOOR:
        row = cand + t.to(tl.int64) * S
        hi = lo + tl.load(count + t.to(tl.int64) * NPARTS + part)
    return row, hi


@triton.jit
def _load_keys(row, offs, hi, FLOOR: tl.constexpr):
    """`_keys` of scores, or (``FLOOR``) candidate keys, finite and in range by construction."""
    if FLOOR:
        m = offs < hi
        return tl.load(row + offs, mask=m, other=0), m
    else:
        return _keys(row, offs, hi)


@triton.jit
def _hist_kernel(
    scores, stride_s, S, limits, req_index, hist, cand, cand_pos, count, k, PART, NPARTS,
    PASS: tl.constexpr, LIMITS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
    DIGIT_BITS: tl.constexpr, SPARSE_KEYS: tl.constexpr, FLOOR: tl.constexpr,
    HISTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Histogram ``PASS`` (0..2) of the row: its byte ``PASS`` among the keys whose higher
    bytes equal those the earlier histograms found. With ``FLOOR``, the first pass keeps the
    part's keys at or above the row's floor, in position order, as the candidates that the
    later launches read instead of the scores (keys, positions and their count)."""
    grid_dependency_wait(GDC)
    t, part, lo, hi, row = _program(scores, stride_s, S, limits, req_index, PART, LIMITS)
    hist_row = hist + t.to(tl.int64) * (HISTS * BINS)
    bins = tl.arange(0, BINS)
    if PASS == 0 and part == 0:  # the last byte's histogram, as the previous call left it
        tl.store(hist_row + 3 * BINS + bins, 0)
    if PASS > 0:
        row, hi = _candidates(t, part, lo, hi, row, cand, count, S, NPARTS, FLOOR)
    prefix, rem, _total = _descend(hist_row, k, PASS, BINS, DIGIT_BITS)
    dest = hist_row + PASS * BINS
    go = lo < hi
    if PASS > 0:
        go = go & (rem > 0)  # rem == 0: the row has no finite score
    kept = 0
    if go:
        if PASS == 0 and FLOOR:  # the lower edge of the 16-bit bin of the k-th group maximum
            fprefix, _frem, maxima = _descend(hist_row + 4 * BINS, k, 2, BINS, DIGIT_BITS)
            floor = tl.where(maxima >= k, (fprefix << 16) ^ INT32_MIN, INT32_MIN)
            crow = cand + t.to(tl.int64) * S
            prow = cand_pos + t.to(tl.int64) * S
        acc = tl.zeros([BINS], dtype=tl.int32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            if PASS == 0:
                u, take = _keys(row, offs, hi)
            else:
                u, take = _load_keys(row, offs, hi, FLOOR)
            digit = (u >> (32 - DIGIT_BITS * (PASS + 1))) & (BINS - 1)
            if PASS > 0:
                high = (u >> (32 - DIGIT_BITS * PASS)) & ((1 << (DIGIT_BITS * PASS)) - 1)
                take = take & (high == prefix)
            if PASS == 0 and FLOOR:
                take = take & ((u ^ INT32_MIN) >= floor)
            if PASS == 0 and not FLOOR:
                acc += tl.histogram(digit, BINS, mask=take)
            else:
                ti = take.to(tl.int32)
                n = tl.sum(ti, axis=0)
                if n > 0:
                    if PASS == 0:  # keep them, in position order (their histogram: below)
                        dst = lo + kept + tl.cumsum(ti, axis=0) - ti
                        tl.store(crow + dst, u, mask=take)
                        tl.store(prow + dst, offs, mask=take)
                        kept += n
                    elif n > SPARSE_KEYS:
                        acc += tl.histogram(digit, BINS, mask=take)
                    else:  # few keys: one atomic each
                        ones = tl.full([BLOCK], 1, tl.int32)
                        tl.atomic_add(dest + digit, ones, mask=take, sem="relaxed")
        if PASS == 0 and FLOOR:  # the first byte of the part's candidates, read back once
            # (one atomic a key would land on the one or two bins a row's candidates share)
            tl.debug_barrier()  # (the CTA's stores above visible to all its threads)
            for start in range(lo, lo + kept, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                m = offs < lo + kept
                u = tl.load(crow + offs, mask=m, other=0)
                acc += tl.histogram((u >> (32 - DIGIT_BITS)) & (BINS - 1), BINS, mask=m)
        tl.atomic_add(dest + bins, acc, mask=acc != 0, sem="relaxed")  # (bins it has keys in)
    if PASS == 0 and FLOOR:
        tl.store(count + t.to(tl.int64) * NPARTS + part, kept)


@triton.jit
def _last_kernel(
    scores, stride_s, S, limits, req_index, hist, cand, count, counts, found, k, PART, NPARTS,
    LIMITS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
    DIGIT_BITS: tl.constexpr, FLOOR: tl.constexpr, HISTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """The last byte's histogram, and each part's counts for the write launch: its keys
    above the three bytes found, and its own last-byte histogram as suffix sums."""
    grid_dependency_wait(GDC)
    t, part, lo, hi, row = _program(scores, stride_s, S, limits, req_index, PART, LIMITS)
    row, hi = _candidates(t, part, lo, hi, row, cand, count, S, NPARTS, FLOOR)
    hist_row = hist + t.to(tl.int64) * (HISTS * BINS)
    prefix, rem, total = _descend(hist_row, k, 3, BINS, DIGIT_BITS)
    if part == 0:  # the row's three bytes, keys still to take and finite count
        f = found + t.to(tl.int64) * 3
        tl.store(f, prefix)
        tl.store(f + 1, rem)
        tl.store(f + 2, total)
    bins = tl.arange(0, BINS)
    gt = tl.full([], 0, tl.int32)
    acc = tl.zeros([BINS], dtype=tl.int32)
    if (lo < hi) & (rem > 0):  # rem == 0: no finite score in the row, nothing to take
        for start in range(lo, hi, BLOCK):
            u, ok = _load_keys(row, start + tl.arange(0, BLOCK), hi, FLOOR)
            high = (u >> DIGIT_BITS) & ((1 << (32 - DIGIT_BITS)) - 1)
            gt += tl.sum((ok & (high > prefix)).to(tl.int32), axis=0)
            take = ok & (high == prefix)
            if tl.sum(take.to(tl.int32), axis=0) > 0:
                acc += tl.histogram(u & (BINS - 1), BINS, mask=take)
        tl.atomic_add(hist_row + 3 * BINS + bins, acc, mask=acc != 0, sem="relaxed")
    c = counts + (t.to(tl.int64) * NPARTS + part) * (BINS + 2)
    tl.store(c, gt)
    tl.store(c + 1 + bins, tl.cumsum(acc, axis=0, reverse=True))
    tl.store(c + 1 + BINS, 0)


@triton.jit
def _write_kernel(
    scores, stride_s, S, limits, req_index, hist, cand, cand_pos, count, counts, found, out,
    stride_o, k, top_k, PART, NPARTS, LIMITS: tl.constexpr, BLOCK: tl.constexpr,
    BINS: tl.constexpr, DIGIT_BITS: tl.constexpr, PARTS_P2: tl.constexpr,
    PAD_BLOCK: tl.constexpr, CLEAR: tl.constexpr, FLOOR: tl.constexpr, HISTS: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    t, part, lo, hi, row = _program(scores, stride_s, S, limits, req_index, PART, LIMITS)
    row, hi = _candidates(t, part, lo, hi, row, cand, count, S, NPARTS, FLOOR)
    orow = out + t.to(tl.int64) * stride_o
    f = found + t.to(tl.int64) * 3
    prefix = tl.load(f)
    rem = tl.load(f + 1)
    total = tl.load(f + 2)
    hist_row = hist + t.to(tl.int64) * (HISTS * BINS)
    # the last byte of the k-th key, and how many keys equal to it to take
    bins = tl.arange(0, BINS)
    h = tl.load(hist_row + 3 * BINS + bins)
    at_least = tl.cumsum(h, axis=0, reverse=True)
    d = tl.max(tl.where(at_least >= rem, bins, 0), axis=0)
    need_eq = rem - tl.sum(tl.where(bins > d, h, 0), axis=0)
    if CLEAR and part == 0:  # no program reads histograms other than the fourth: zero them
        every = tl.arange(0, 8 * BINS)
        tl.store(hist_row + every, 0, mask=(every < HISTS * BINS) & (every // BINS != 3))
    kth = ((prefix << DIGIT_BITS) | d) ^ INT32_MIN
    taken_all = tl.minimum(k, total)
    # where this part's picks start: the picks and ties of the parts before it
    j = tl.arange(0, PARTS_P2)
    before = j < part
    c = counts + (t.to(tl.int64) * NPARTS + j) * (BINS + 2)
    above_d = tl.load(c + 2 + d, mask=before, other=0)  # (suffix sums: keys past byte d)
    gt_j = tl.load(c, mask=before, other=0) + above_d
    eq_j = tl.load(c + 1 + d, mask=before, other=0) - above_d
    eq_seen = tl.sum(eq_j, axis=0)
    eq_excl = tl.cumsum(eq_j, axis=0) - eq_j
    ties_j = tl.minimum(tl.maximum(need_eq - eq_excl, 0), eq_j)
    slot = tl.sum(gt_j + ties_j, axis=0)
    if need_eq > 0:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            u, ok = _load_keys(row, offs, hi, FLOOR)
            u = u ^ INT32_MIN
            is_eq = (ok & (u == kth)).to(tl.int32)
            n_eq = tl.sum(is_eq, axis=0)
            take = ok & (u > kth)
            if n_eq > 0:  # the k-th key's ties in this block: the first ones still to take
                eq_rank = eq_seen + tl.cumsum(is_eq, axis=0) - is_eq
                take = take | ((is_eq != 0) & (eq_rank < need_eq))
            ti = take.to(tl.int32)
            n_take = tl.sum(ti, axis=0)
            if n_take > 0:
                dst = slot + tl.cumsum(ti, axis=0) - ti
                pos = offs.to(tl.int32)
                if FLOOR:  # the candidates' positions
                    pos = tl.load(cand_pos + t.to(tl.int64) * S + offs, mask=take)
                tl.store(orow + dst, pos, mask=take)
            slot += n_take
            eq_seen += n_eq
    if part == 0:  # the padding after the row's picks
        for start in range(0, top_k, PAD_BLOCK):
            cols = start + tl.arange(0, PAD_BLOCK)
            tl.store(orow + cols, tl.full([PAD_BLOCK], -1, tl.int32),
                     mask=(cols >= taken_all) & (cols < top_k))  # fmt: skip


def _parts(t: int, s: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs per row: about ``per_sm`` per SM over the whole call, none shorter than
    `MIN_PART`."""
    sms = num_sms(device)
    return max(1, min(triton.cdiv(per_sm * sms, max(t, 1)), triton.cdiv(s, MIN_PART)))


def topk_select_triton(
    scores: Tensor,
    top_k: int,
    out: Tensor | None = None,
    limits: Tensor | None = None,
    *,
    positions: Tensor | None = None,
    req_index: Tensor | None = None,
    parts: int | None = None,
    floor: bool = True,
    maxima: GroupMaxima | None = None,
) -> Tensor:
    """`topk_select_reference`'s contract, written into ``out`` (every element) when given.
    ``scores``: fp32 ``[T, S]``; row ``t`` reads keys below ``limits[t]``, or below a
    token's causal limit ``positions[t] + 1`` (none where ``req_index[t] < 0``): the same
    picks as without, where the scores past those limits are ``-inf``, read in less time.
    ``maxima``: `group_maxima`'s buffers for this call (its histograms are then the call's;
    when ``filled``, the floor's first launch is skipped)."""
    t, s = scores.shape
    if out is None:
        out = torch.empty((t, top_k), dtype=torch.int32, device=scores.device)
    if t == 0 or top_k == 0:
        return out
    if out.stride(1) != 1 or out.dtype != torch.int32:  # the kernel writes int32 rows
        out.copy_(topk_select_triton(scores, top_k, None, limits, positions=positions,
                                     req_index=req_index, parts=parts, floor=floor,
                                     maxima=maxima))  # fmt: skip
        return out
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        scores = scores.float().contiguous()
    # per-row values are read at offset t: contiguous (a no-op on the engine's own tensors)
    limits, positions, req_index = (
        None if v is None else v.contiguous() for v in (limits, positions, req_index)
    )
    k = min(top_k, s)
    group = _call_floor_group(t, s, k) if floor else 0
    per_sm = FLOOR_PROGRAMS_PER_SM if group else PROGRAMS_PER_SM
    p = parts or _parts(t, s, scores.device, per_sm)
    per = triton.cdiv(max(s, 1), p)
    block = BLOCK if per >= BLOCK else max(MIN_BLOCK, triton.next_power_of_2(per))
    part = triton.cdiv(per, block) * block
    p = max(1, triton.cdiv(s, part))
    if maxima is not None and maxima.group != group:
        raise ValueError(f"group maxima of {maxima.group} keys for a call of groups of {group}")
    hist, clear = (maxima.hist, maxima.clear) if maxima else _histograms(t, scores.device)
    counts = torch.empty((t, p, BINS + 2), dtype=torch.int32, device=scores.device)
    found = torch.empty((t, 3), dtype=torch.int32, device=scores.device)
    mode, lim, req = 0, hist, hist  # (pointers not read in mode 0)
    if limits is not None:
        mode, lim = 1, limits
    elif positions is not None:
        mode, lim = 2, positions
        req = req_index if req_index is not None else positions  # positions >= 0: all real
    gdc = dependent_launch(scores.device) and part <= PDL_MAX_PART
    common = dict(LIMITS=mode, BINS=BINS, HISTS=HISTS, GDC=gdc)
    if gdc:  # each launch starts while the one before finishes (a launch gap fewer each)
        common["launch_pdl"] = True
    grid = (t, p)
    head = (scores, scores.stride(0), s, lim, req, hist)
    cand = cand_pos = count = hist  # (not read without the floor)
    if group:  # the floor from group maxima's first two bytes; room for the candidates
        gmax = (
            maxima.gmax
            if maxima
            else torch.empty((t, triton.cdiv(s, group)), dtype=torch.int32, device=scores.device)
        )
        cand = torch.empty((t, s), dtype=torch.int32, device=scores.device)  # keys, positions:
        cand_pos = torch.empty_like(cand)  # each part's from its first key's slot on
        count = torch.empty((t, p), dtype=torch.int32, device=scores.device)
        if not (maxima and maxima.filled):
            _floor_max_kernel[grid](*head, gmax, gmax.stride(0), part, BLOCK=block,
                                    GROUP=group, **common)  # fmt: skip
        gblock = min(FLOOR_BYTE_BLOCK, triton.next_power_of_2(triton.cdiv(part, group)))
        _floor_byte_kernel[grid](*head, gmax, gmax.stride(0), k, part, GBLOCK=gblock,
                                 DIGIT_BITS=DIGIT_BITS, GROUP=group, **common)  # fmt: skip
    common.update(BLOCK=block, DIGIT_BITS=DIGIT_BITS, FLOOR=bool(group))
    for pas in range(PASSES - 1):
        _hist_kernel[grid](*head, cand, cand_pos, count, k, part, p, PASS=pas,
                           SPARSE_KEYS=SPARSE_KEYS, **common)  # fmt: skip
        if group and pas == 0:  # the launches after the compaction read a part's candidates
            common["BLOCK"] = min(block, FLOOR_CAND_BLOCK)
    _last_kernel[grid](*head, cand, count, counts, found, k, part, p, **common)
    _write_kernel[grid](
        *head, cand, cand_pos, count, counts, found, out, out.stride(0), k, top_k, part, p,
        PARTS_P2=triton.next_power_of_2(p), PAD_BLOCK=min(1024, triton.next_power_of_2(top_k)),
        CLEAR=clear, **common,
    )  # fmt: skip
    return out


__all__ = ["topk_select_reference", "topk_select_triton"]
