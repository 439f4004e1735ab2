"""``x @ weight.T`` for the few rows of a decode step, streaming the weight at HBM speed.

A decode step's projections multiply a handful of rows (one per running request) by a large
weight: the time is the weight's bytes. This kernel computes ``out.T = weight @ x.T``: a program owns ``BLOCK_N``
weight rows and one of ``splits`` slices of the reduction, streams its ``[BLOCK_N, BLOCK_K]``
weight tiles through a software pipeline and multiplies each by the ``[BLOCK_K, BLOCK_M]``
transposed rows (``BLOCK_M`` = 16 or 32, padding rows masked) with fp32 accumulation. With
several splits, each writes an fp32 partial and `_sum_splits_kernel` adds them in split order:
the result does not depend on scheduling (no atomics), so both placements and every replay
give the same bits. The reference is ``F.linear`` (fp32 accumulation as well, in another
order: values agree to rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from hisparse.runtime.ops import triton_common  # noqa: F401  (the interpreter's loop-bound fix)

#: The most rows the kernel takes (`BLOCK_M` 32); more rows are a matmul cuBLAS tiles well.
MAX_ROWS = 32
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_OUT: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + m[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + kk
        k_ok = k < k_end
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    mask = n_ok[:, None] & m_ok[None, :]
    if not SPLIT_OUT:
        tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(OUT_DTYPE), mask=mask)
    else:
        part = part_ptr + pid_s.to(tl.int64) * M * N
        tl.store(part + m[None, :] * N + n[:, None], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, M, N, splits, stride_om,
    OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[m, n] = sum over s in order of part[s, m, n]`` (fp32), cast once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    m = i // N
    n = i % N
    tl.store(out_ptr + m * stride_om + n, acc.to(OUT_DTYPE), mask=ok)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, splits, num_stages, num_warps)`` for ``m`` rows of an
    ``[n, k]`` weight: enough programs for several waves of loads in flight (a reduction
    slice of at least four tiles), one program's tiles small enough for a deep pipeline."""
    block_m = 16 if m <= 16 else 32
    block_n, block_k = 64, 128
    tiles_n = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    splits = max(1, min(triton.cdiv(4 * sms, tiles_n), k_tiles // 4))
    return block_m, block_n, block_k, splits, 4, 4


def skinny_linear(
    x: Tensor, weight: Tensor, config: tuple[int, int, int, int, int, int] | None = None
) -> Tensor:
    """``x @ weight.T`` for ``x [M, K]`` (``M <= MAX_ROWS``, unit stride on K) and a
    contiguous ``weight [N, K]`` of x's dtype (bf16 or fp16); ``config``: `pick_config`'s
    tuple (benchmarks sweep it)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"skinny_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    block_m, block_n, block_k, splits, stages, warps = config or pick_config(
        m, n, k, num_sms(x.device)
    )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    dtype = _TL[x.dtype]
    _skinny_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, out, part, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        OUT_DTYPE=dtype, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_OUT=splits > 1, NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, out, m, n, splits, out.stride(0), OUT_DTYPE=dtype, BLOCK=block
        )
    return out


def skinny_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """What `skinny_linear` computes, by torch: ``F.linear`` in fp32, cast to x's dtype."""
    return F.linear(x.float(), weight.float()).to(x.dtype)
