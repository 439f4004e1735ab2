"""The radix select's shared pieces, used by both the select (`topk_triton`) and its floor
(`topk_floor`): a score's key (fp32 bits flipped so that their unsigned order is the float
order), a program's part of a row, the byte descent through a row's histograms, and the
per-row histogram buffers (zero at rest up to `KEPT_HIST_ROWS` rows, see `topk_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Bytes of a key found per histogram launch (four launches: 32 bits).
DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
INT32_MIN = tl.constexpr(-(2**31))
#: Histograms per row: the select's four bytes, then the floor's two (bytes 0 and 1 of the
#: group maxima).
HISTS = 6
#: Rows of the zero-at-rest histogram buffer kept per device (see `topk_triton`'s docstring).
KEPT_HIST_ROWS = 64
_kept_hist: dict[torch.device, Tensor] = {}


@triton.jit
def _keys(row, offs, hi):
    """Scores ``row[offs]`` (``offs < hi``) as int32 bits whose unsigned order is the float
    order, and which of them are finite picks (not ``-inf``, not NaN, in range). ``-0.0``
    counts as ``0.0``, as the float compare (and ``torch.topk``) has it."""
    m = offs < hi
    x = tl.load(row + offs, mask=m, other=float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    # negative floats: flip all bits; positive: flip the sign bit
    return bits ^ ((bits >> 31) | INT32_MIN), m & (x > float("-inf"))  # NaN compares false


@triton.jit
def _program(scores, stride_s, S, limits, req_index, PART, LIMITS: tl.constexpr):
    """This program's row ``t``, part, its keys ``[lo, hi)`` and the row's scores. Row ``t``
    may pick: all ``S`` keys; ``limits[t]`` (LIMITS 1); a token's causal limit
    ``limits[t] + 1``, none for a padding token (``req_index[t] < 0``) (LIMITS 2)."""
    t = tl.program_id(0)
    part = tl.program_id(1)
    n = S
    if LIMITS == 1:
        n = tl.load(limits + t).to(tl.int32)
    if LIMITS == 2:
        n = tl.load(limits + t).to(tl.int32) + 1
        n = tl.where(tl.load(req_index + t) >= 0, n, 0)
    n = tl.minimum(tl.maximum(n, 0), S)
    lo = part * PART
    return t, part, lo, tl.minimum(lo + PART, n), scores + t.to(tl.int64) * stride_s


@triton.jit
def _descend(hist_row, k, NPASS: tl.constexpr, BINS: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The key bytes found by the first ``NPASS`` histograms of a row, how many of the keys
    sharing them are still to take, and the row's count of finite scores."""
    bins = tl.arange(0, BINS)
    total = tl.sum(tl.load(hist_row + bins), axis=0)
    rem = tl.minimum(k, total)
    prefix = total * 0
    for p in tl.static_range(NPASS):
        h = tl.load(hist_row + p * BINS + bins)
        at_least = tl.cumsum(h, axis=0, reverse=True)  # keys whose byte is >= each bin
        d = tl.max(tl.where(at_least >= rem, bins, 0), axis=0)
        above = tl.sum(tl.where(bins > d, h, 0), axis=0)
        rem = rem - above
        prefix = (prefix << DIGIT_BITS) | d
    return prefix, rem, total


def _histograms(t: int, device: torch.device) -> tuple[Tensor, bool]:
    """Histograms for ``t`` rows, all zero but the fourth (the first histogram launch zeroes it),
    and whether the write launch must zero them again: the device's kept buffer up to
    `KEPT_HIST_ROWS` rows (made outside a graph capture, so that it outlives every graph that
    bakes its address), else a fresh one."""
    if t <= KEPT_HIST_ROWS:
        kept = _kept_hist.get(device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if kept is None and not capturing:
            shape = (KEPT_HIST_ROWS, HISTS, BINS)
            kept = _kept_hist[device] = torch.zeros(shape, dtype=torch.int32, device=device)
        if kept is not None:
            return kept, True
    return torch.zeros((t, HISTS, BINS), dtype=torch.int32, device=device), False
