"""The top-k's floor: for a decode batch of long rows, two launches before the select's first
histogram find, per row, a floor below which no pick lies, so that the select reads a few
thousand candidates a row instead of every score (`topk_triton`'s docstring tells how the
select uses it). Split from the select so that the floor (when a call takes one, how it is
found, its references) reads on its own.

Its two launches: the largest key of each group of 16 (the row's finite keys only), and a
histogram of the first byte of those maxima; then the second byte's, among the maxima that
share the first byte of the row's k-th largest maximum. The floor is the lower edge of that
16-bit bin: at least ``k`` groups have a maximum at or above it, each a distinct key, so the
row's ``k`` largest keys all are (rows of fewer than ``k`` maxima get none: every key). A score
kernel can write the maxima and their first-byte histogram with the scores (`GroupMaxima`,
`indexer_gluon`): then the first of these launches is skipped.

The floor is decided per call (`_call_floor_group`: rows, keys and picks), the same way by
`group_maxima` (a score kernel's buffers) and by the select.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.attention.topk_radix import INT32_MIN, _descend, _histograms, _keys, _program
from hisparse.runtime.ops.triton_common import grid_dependency_wait

#: Widest key group whose maximum the floor takes, and the fewest group maxima per pick: a
#: call gets a floor when its groups, at most `FLOOR_GROUP` keys wide, can be at least
#: `FLOOR_MIN_GROUP` wide with `FLOOR_MAXIMA_PER_PICK` maxima per pick (``k`` 2048: rows of
#: 128K keys and more).
FLOOR_GROUP = 16
FLOOR_MIN_GROUP = 16
FLOOR_MAXIMA_PER_PICK = 4
#: Rows a call must have for the floor, and may have (the candidates take 8 bytes a key).
#: docs/benchmarks.md §15: with the floor 16, 29 and 64 rows of 128K were faster; 8 rows
#: and rows of 32K (groups of 4) slower, the launches after the compaction costing more than
#: the passes over every key they replace.
FLOOR_MIN_ROWS = 16
FLOOR_MAX_ROWS = 64


@dataclass
class GroupMaxima:
    """The floor's group maxima of one call's scores, for a score kernel to write beside the
    scores (`indexer_gluon`), saving the floor's first launch: ``gmax`` ``int32 [T, S / group]``
    (each ``group`` keys' largest finite key in signed order, `INT32_MIN` for none, up to each
    row's limit), and the maxima's first-byte histogram added into histogram 4 of ``hist``,
    the call's histograms (`_histograms`). ``filled``: the writer sets it; the select
    computes the maxima itself when it is not."""

    group: int
    gmax: Tensor
    hist: Tensor
    clear: bool
    filled: bool = False


def group_maxima(t: int, s: int, top_k: int, device: torch.device) -> GroupMaxima | None:
    """Buffers for the group maxima of a ``[t, s]`` call with ``top_k`` picks, where the select
    takes a floor (else None). The histograms are the ones that call's select will use: a
    writer adds to them, so a call that gets these must run the select after it."""
    group = _call_floor_group(t, s, min(top_k, s))
    if not group:
        return None
    hist, clear = _histograms(t, device)
    gmax = torch.empty((t, triton.cdiv(s, group)), dtype=torch.int32, device=device)
    return GroupMaxima(group, gmax, hist, clear)


def _signed_keys(scores: Tensor, limits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The select's keys as signed ints in the floats' order (``-0.0`` as ``0.0``), and which
    are finite picks (not ``-inf``, not NaN, below the row's limit when given)."""
    x = torch.where(torch.isnan(scores), float("-inf"), scores.float())
    if limits is not None:
        pos = torch.arange(x.shape[1], device=x.device)
        x = torch.where(pos[None, :] < limits.to(x.device).long()[:, None], x, float("-inf"))
    bits = torch.where(x == 0, 0.0, x).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), x > float("-inf")


def group_maxima_reference(
    scores: Tensor, group: int, limits: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`GroupMaxima`'s contract: ``int32 [T, S / group]`` each group's largest finite score
    below the row's limit in signed key order (``INT32_MIN`` for none), and ``int32 [T, 256]``
    the histogram of the first key byte of the maxima that are not."""
    v, finite = _signed_keys(scores, limits)
    v = torch.where(finite, v, -(2**31))
    pad = (-v.shape[1]) % group
    gm = torch.nn.functional.pad(v, (0, pad), value=-(2**31)).view(v.shape[0], -1, group)
    gm = gm.amax(dim=2)
    byte = ((gm ^ -(2**31)) >> 24) & 0xFF
    hist = torch.zeros((v.shape[0], 256), dtype=torch.int32, device=v.device)
    hist.scatter_add_(1, byte.long(), (gm > -(2**31)).to(torch.int32))
    return gm.to(torch.int32), hist


def floor_counts_reference(scores: Tensor, top_k: int, group: int) -> Tensor:
    """Per row, the keys the floor keeps (``int32 [T]``): the finite scores at or above the
    lower edge of the 16-bit bin (in the select's key order) of the row's ``top_k``-th
    largest ``group``-key maximum; every finite score in a row of fewer finite maxima."""
    v, finite = _signed_keys(scores)
    gm = group_maxima_reference(scores, group)[0]
    counts = []
    for r in range(v.shape[0]):
        m = gm[r][gm[r] > -(2**31)]
        if m.numel() < top_k:
            counts.append(int(finite[r].sum()))
            continue
        kth = m.sort(descending=True).values[top_k - 1]
        floor = (((kth ^ -(2**31)) >> 16) << 16) ^ -(2**31)  # low 16 bits of the key cleared
        counts.append(int((finite[r] & (v[r] >= floor)).sum()))
    return torch.tensor(counts, dtype=torch.int32)


@triton.jit
def _floor_max_kernel(
    scores, stride_s, S, limits, req_index, hist, gmax, stride_g, PART,
    LIMITS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, GROUP: tl.constexpr,
    HISTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """The floor's first launch: each ``GROUP`` keys' largest finite key (signed order,
    ``INT32_MIN`` for none) into ``gmax``, and the maxima's first byte into histogram 4."""
    grid_dependency_wait(GDC)
    t, _part, lo, hi, row = _program(scores, stride_s, S, limits, req_index, PART, LIMITS)
    hist_row = hist + t.to(tl.int64) * (HISTS * BINS)
    grow = gmax + t.to(tl.int64) * stride_g
    bins = tl.arange(0, BINS)
    acc = tl.zeros([BINS], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        u, take = _keys(row, start + tl.arange(0, BLOCK), hi)
        v = tl.where(take, u ^ INT32_MIN, INT32_MIN)
        m = tl.max(tl.reshape(v, [BLOCK // GROUP, GROUP]), axis=1)
        g = start // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(grow + g, m, mask=g * GROUP < hi)
        acc += tl.histogram(((m ^ INT32_MIN) >> 24) & (BINS - 1), BINS, mask=m > INT32_MIN)
    tl.atomic_add(hist_row + 4 * BINS + bins, acc, mask=acc != 0, sem="relaxed")


@triton.jit
def _floor_byte_kernel(
    scores, stride_s, S, limits, req_index, hist, gmax, stride_g, k, PART,
    LIMITS: tl.constexpr, GBLOCK: tl.constexpr, BINS: tl.constexpr, DIGIT_BITS: tl.constexpr,
    GROUP: tl.constexpr, HISTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """The floor's second launch: the second byte of the group maxima whose first byte is
    that of the row's k-th largest maximum, into histogram 5 (rows of fewer than ``k``
    maxima: none, they get no floor)."""
    grid_dependency_wait(GDC)
    t, _part, lo, hi, _row = _program(scores, stride_s, S, limits, req_index, PART, LIMITS)
    hist_row = hist + t.to(tl.int64) * (HISTS * BINS)
    grow = gmax + t.to(tl.int64) * stride_g
    bins = tl.arange(0, BINS)
    d0, _rem, total = _descend(hist_row + 4 * BINS, k, 1, BINS, DIGIT_BITS)
    g_hi = (hi + GROUP - 1) // GROUP
    if (lo < hi) & (total >= k):
        acc = tl.zeros([BINS], dtype=tl.int32)
        for gs in range(lo // GROUP, g_hi, GBLOCK):
            g = gs + tl.arange(0, GBLOCK)
            u = tl.load(grow + g, mask=g < g_hi, other=INT32_MIN) ^ INT32_MIN
            take = (u != 0) & (((u >> 24) & (BINS - 1)) == d0)
            acc += tl.histogram((u >> 16) & (BINS - 1), BINS, mask=take)
        tl.atomic_add(hist_row + 5 * BINS + bins, acc, mask=acc != 0, sem="relaxed")


def _call_floor_group(t: int, s: int, k: int) -> int:
    """`_floor_group` for a call of ``t`` rows: 0 (no floor) outside `FLOOR_MIN_ROWS` ..
    `FLOOR_MAX_ROWS` rows. `group_maxima` and the select both ask it, so they agree."""
    return _floor_group(s, k) if FLOOR_MIN_ROWS <= t <= FLOOR_MAX_ROWS else 0


def _floor_group(s: int, k: int) -> int:
    """Keys per group of the floor's maxima for rows of ``s`` keys and ``k`` picks: the widest
    power of two up to `FLOOR_GROUP` that leaves `FLOOR_MAXIMA_PER_PICK` maxima per pick, or
    0 (no floor) where that is narrower than `FLOOR_MIN_GROUP`."""
    width = s // max(1, FLOOR_MAXIMA_PER_PICK * k)
    group = min(FLOOR_GROUP, 1 << (width.bit_length() - 1)) if width > 0 else 0
    return group if group >= FLOOR_MIN_GROUP else 0


__all__ = [
    "GroupMaxima",
    "floor_counts_reference",
    "group_maxima",
    "group_maxima_reference",
]
