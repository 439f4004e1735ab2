"""The top-k replay's hash as one Triton kernel (`replay.replay_hash` uses it on CUDA).

`hash_rows(row_bases(seed, salt, keys, lens), cols)` in torch is dozens of tiny element-wise
launches per call, twice per index-group leader and decode step; this is one. Integer ops
only, so it equals the torch form exactly (`tests/test_replay_hash_triton.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.bench.replay import salt_of


@triton.jit
def _mix31_tl(x):
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0x7FFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0x7FFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _replay_hash_kernel(keys, lens, cols, out, s, N, cols_row_stride, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    key = tl.load(keys + r).to(tl.int64)
    length = tl.load(lens + r).to(tl.int64)
    base = _mix31_tl(_mix31_tl((key & 0x7FFFFFFF) ^ s) ^ (length & 0x7FFFFFFF))
    c = tl.load(cols + r * cols_row_stride + offs, mask=m, other=0).to(tl.int64)
    h = _mix31_tl((base + (c & 0x7FFFFFFF) * 40503) & 0x7FFFFFFF)
    tl.store(out + r * N + offs, h, mask=m)


def replay_hash_triton(
    seed: int,
    salt: int,
    keys: torch.Tensor,
    lens: torch.Tensor,
    cols: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`replay_hash` as one kernel (the torch form is dozens of tiny launches)."""
    R = keys.shape[0]
    N = cols.shape[-1]
    if cols.dim() == 2 and cols.shape[0] != R:
        raise ValueError(f"cols has {cols.shape[0]} rows for {R} keys (no broadcasting here)")
    c = cols.contiguous().long()
    if out is None:
        out = torch.empty((R, N), dtype=torch.int64, device=cols.device)
    if R and N:
        block = min(1024, triton.next_power_of_2(N))
        grid = (R, triton.cdiv(N, block))
        row_stride = N if c.dim() == 2 else 0
        _replay_hash_kernel[grid](
            keys.contiguous().long(), lens.contiguous().long(), c, out,
            salt_of(seed, salt), N, row_stride, BLOCK=block,
        )  # fmt: skip
    return out
