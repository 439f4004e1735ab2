"""Triton kernels of the feed-forward's small ops, split from `fused_triton` (whose rounding
helper they use) so that the MoE's and the MLP's kernels read together; the references are
the torch compositions in `hisparse.models.fused`:

* `route_dense`, `moe_combine`: the MoE router's grouped top-k and the experts' weighted sum.
* `silu_mul` (libdevice ``expf``, as torch's silu): the MLP's activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from hisparse.models.fused_triton import _TL_DTYPES, _round
from hisparse.runtime.ops.triton_common import grid_dependency_wait, pdl


# ---------------------------------------------------------------------------------------------
# MoE: the router's grouped top-k, and the combine of the experts' outputs
# ---------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(
    score_ptr, x_ptr, s_x, rw_ptr, H, bias_ptr, w_ptr, chosen_ptr, scaling,
    E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    NORM: tl.constexpr, FROM_X: tl.constexpr, BH: tl.constexpr, LIBDEVICE: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    if FROM_X:  # the scores from the row: an fp32 GEMV over the router weight, then sigmoid
        acc = tl.zeros([E, BH], dtype=tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            m = hh < H
            xv = tl.load(x_ptr + n * s_x + hh, mask=m, other=0.0).to(tl.float32)
            wv = tl.load(rw_ptr + e[:, None] * H + hh[None, :], mask=m[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        logit = tl.sum(acc, axis=1)
        if LIBDEVICE:  # noqa: SIM108  expf, as torch's sigmoid (Triton's exp is ex2.approx)
            ex = libdevice.exp(-logit)
        else:
            ex = tl.exp(-logit)
        s = tl.math.div_rn(1.0, 1.0 + ex)
    else:
        s = tl.load(score_ptr + n * E + e)
    c = s + tl.load(bias_ptr + e)
    EG: tl.constexpr = E // G
    cg = tl.reshape(c, [G, EG])
    j = tl.arange(0, EG)[None, :]
    first = tl.argmax(cg, axis=1)
    gs = tl.max(cg, axis=1)
    if EG > 1:  # a group's score: its two best bias-corrected scores
        gs = gs + tl.max(tl.where(j == first[:, None], float("-inf"), cg), axis=1)
    gi = tl.arange(0, G)
    keep = gi < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(tl.where(keep, float("-inf"), gs), axis=0)
        keep = keep | (gi == best)
    ce = tl.reshape(tl.where(keep[:, None], cg, float("-inf")), [E])
    chosen = e < 0
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(tl.where(chosen, float("-inf"), ce), axis=0)
        chosen = chosen | (e == best)
    w = tl.where(chosen, s, 0.0)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=0) + 1e-20)
    tl.store(w_ptr + n * E + e, w * scaling)
    tl.store(chosen_ptr + n * E + e, chosen.to(tl.int8))


def route_dense(
    scores: Tensor, bias: Tensor, n_group: int, topk_group: int, top_k: int, norm: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """DeepSeek's grouped top-k routing from sigmoid ``scores [N, E]`` (fp32, torch's sigmoid:
    the kernel's own exp would be approximate) -> ``(weights [N, E] fp32, 0 where not chosen;
    chosen [N, E] bool)``. Ties go to the lowest expert or group."""
    n, e = scores.shape
    w = torch.empty((n, e), dtype=torch.float32, device=scores.device)
    chosen = torch.empty((n, e), dtype=torch.int8, device=scores.device)
    if n:
        _route_kernel[(n,)](
            scores.contiguous(), scores, 0, scores, 0, bias.float().contiguous(), w, chosen,
            scaling, E=e, G=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, NORM=norm,
            FROM_X=False, BH=1, LIBDEVICE=False, num_warps=1, **pdl(scores.device),
        )  # fmt: skip
    return w, chosen.view(torch.bool)


def route_dense_rows(
    x: Tensor, weight: Tensor, bias: Tensor, n_group: int, topk_group: int, top_k: int,
    norm: bool, scaling: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`route_dense` from the rows ``x [N, H]`` themselves: one program per row computes its
    scores ``sigmoid(x · weight.T)`` in fp32 (``weight [E, H]``; the GEMV's sum order is the
    kernel's, so a score may differ from cuBLAS's in its last bits) before routing them. One
    launch instead of a cast, a GEMV and a sigmoid; for small ``E · H`` only (each program
    reads the whole weight), which `fused.route_dense` checks."""
    n, h = x.shape
    e = weight.shape[0]
    w = torch.empty((n, e), dtype=torch.float32, device=x.device)
    chosen = torch.empty((n, e), dtype=torch.int8, device=x.device)
    if n:
        # Wide tiles, few iterations: one program per row is latency-bound on its loop of
        # loads (a [E, 512] tile a trip made it the step's slowest small kernel on the H200).
        bh = max(16, min(triton.next_power_of_2(h), 16384 // e))
        _route_kernel[(n,)](
            w, x, x.stride(0), weight.contiguous(), h, bias.float().contiguous(), w, chosen,
            scaling, E=e, G=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, NORM=norm,
            FROM_X=True, BH=bh, LIBDEVICE=x.is_cuda, num_warps=8, **pdl(x.device),
        )  # fmt: skip
    return w, chosen.view(torch.bool)


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, chosen_ptr, shared_ptr, o_ptr, N, H,
    E: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = h < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for e in range(E):  # ascending experts, rounded after each add: the loop's sum
        w = tl.load(w_ptr + n * E + e)
        pick = tl.load(chosen_ptr + n * E + e) != 0
        y = tl.load(y_ptr + (e * N + n) * H + h, mask=m & pick, other=0.0).to(tl.float32)
        acc = tl.where(pick, _round(acc + _round(y * w, DT), DT), acc)
    shared = tl.load(shared_ptr + n * H + h, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + n * H + h, _round(acc + shared, DT).to(DT), mask=m)


def moe_combine(y: Tensor, w: Tensor, chosen: Tensor, shared: Tensor) -> Tensor:
    """``Σ_e chosen · (y[e] · w[:, e])`` plus ``shared``: the MoE's output from the experts'
    ``y [E, N, H]``, each term and each partial sum rounded to ``y``'s dtype in ascending
    expert order (the per-expert loop's order)."""
    e, n, h = y.shape
    out = torch.empty((n, h), dtype=y.dtype, device=y.device)
    if n:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(n, triton.cdiv(h, block))](
            y.contiguous(), w.contiguous(), chosen.contiguous().view(torch.int8),
            shared.contiguous(), out, n, h, E=e, BLOCK=block, DT=_TL_DTYPES[y.dtype],
            **pdl(y.device),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# MLP activation
# ---------------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(
    x_ptr, x_stride, o_ptr, inter,
    BLOCK: tl.constexpr, DT: tl.constexpr, LIBDEVICE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    grid_dependency_wait(GDC)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    g = tl.load(x_ptr + row * x_stride + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + inter + i, mask=m, other=0.0).to(tl.float32)
    if LIBDEVICE:  # noqa: SIM108  expf, as torch's silu (Triton's exp is ex2.approx on CUDA)
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = _round(tl.math.div_rn(g, 1.0 + e), DT)
    tl.store(o_ptr + row * inter + i, _round(act * u, DT).to(DT), mask=m)


def silu_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` of rows ``x [..., 2I]`` (the last dim contiguous,
    the rows evenly strided), each op rounded to ``x``'s dtype as torch rounds it."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, rows.stride(0), out, inter, BLOCK=block, DT=_TL_DTYPES[x.dtype],
            LIBDEVICE=x.is_cuda, **pdl(x.device),
        )  # fmt: skip
    return out
