"""Shared pieces of the split-top-k attention kernels (sparse MLA and sparse GQA decode).

A token's top-k rows may be split over several programs (flash-decoding) when one program per
(token, head block) would leave SMs idle; each split writes a partial output and its log-sum-exp,
and `combine_splits` merges them. The SM count sizes those splits (and the indexer's chunks).

CUDA caps grid axes 1 and 2 at 65535 programs (axis 0 at 2^31 - 1). A launch whose axis 1
counts query tokens (a prefill chunk may hold far more) goes out in slices of at most
`MAX_GRID_YZ` tokens (`grid_slices`); the combine kernel puts tokens on axis 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hisparse.runtime.ops.triton_common import grid_dependency_wait, pdl

#: Most programs on grid axis 1 or 2 of one launch (CUDA's limit; tests lower it so the
#: sliced launches run at interpreter sizes).
MAX_GRID_YZ = 65535


def grid_slices(n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``0 .. n - 1`` in order, each at most `MAX_GRID_YZ`
    long: one launch per range where ``n`` would be a grid's axis 1 or 2."""
    step = MAX_GRID_YZ
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 stands in on the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def _combine_kernel(
    part_ptr,
    plse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    s_p_t,
    s_p_h,
    s_p_s,
    s_pl_t,
    s_pl_h,
    s_o_t,
    s_o_h,
    s_l_t,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GDC: tl.constexpr,
):
    """Merge the splits of one (token, head): weights ``exp(lse_s - max)``. Tokens are grid
    axis 0 (unbounded), heads axis 1."""
    grid_dependency_wait(GDC)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < num_splits
    lses = tl.load(plse_ptr + t * s_pl_t + h * s_pl_h + sidx, mask=smask, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lses - m_safe)  # -inf splits (and padding) weigh 0
    total = tl.sum(w, 0)
    c = tl.arange(0, D)
    parts = tl.load(
        part_ptr + t * s_p_t + h * s_p_h + sidx[:, None] * s_p_s + c[None, :],
        mask=smask[:, None],
        other=0.0,
    )
    has = total > 0
    acc = tl.sum(parts * w[:, None], 0) / tl.where(has, total, 1.0)
    tl.store(out_ptr + t * s_o_t + h * s_o_h + c, acc.to(out_ptr.dtype.element_ty))
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * s_l_t + h, lse)


def split_length(top_k: int, splits: int, block_n: int) -> int:
    """Rows per split: ``top_k`` over ``splits``, rounded up to whole ``block_n`` steps."""
    return triton.cdiv(triton.cdiv(max(top_k, 1), splits), block_n) * block_n


def split_buffers(
    t: int, h: int, d: int, splits: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``(out [t, h, d], lse [t, h], parts, part_lse, part strides, part_lse strides)``: with
    one split the kernel writes ``out`` / ``lse`` directly (split stride 0), else fp32 partial
    buffers ``[t, h, splits, d]`` / ``[t, h, splits]`` for `combine_splits`."""
    out = torch.empty(t, h, d, dtype=dtype, device=device)
    lse = torch.empty(t, h, dtype=torch.float32, device=device)
    if splits == 1:
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1), 0)
        return out, lse, out, lse, so, sl
    parts = torch.empty(t, h, splits, d, dtype=torch.float32, device=device)
    part_lse = torch.empty(t, h, splits, dtype=torch.float32, device=device)
    so = (parts.stride(0), parts.stride(1), parts.stride(2))
    sl = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    return out, lse, parts, part_lse, so, sl


def combine_splits(
    parts: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """``out [T, H, D]`` and ``lse [T, H]`` from ``parts [T, H, S, D]`` (fp32 partial outputs,
    each normalised over its split) and ``part_lse [T, H, S]``; a (token, head) whose splits
    all saw no row gets out 0 and lse -inf."""
    t, h, splits, d = parts.shape
    _combine_kernel[(t, h)](
        parts, part_lse, out, lse, splits,
        parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        D=d, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4, **pdl(parts.device),
    )  # fmt: skip
