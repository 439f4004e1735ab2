"""The Triton kernels of `hisparse.engine.decode_inputs`: the step's inputs (one program per
table and row) and its per-request counts (one program per request)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.engine.decode_inputs import DecodeInputs
from hisparse.runtime.ops import triton_common  # noqa: F401  (the interpreter's loop-bound fix)


@triton.jit
def _decode_inputs_kernel(
    pos_ptr, slot_ptr, table_ptr, s_tg, s_ts, stack_ptr, rows_ptr, rix_ptr, lens_ptr,
    state_ptr, rix32_ptr, slot32_ptr, b, MB, block_size, spare, BLOCK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + r)
    slot = tl.load(slot_ptr + r)
    valid = slot >= 0
    src = table_ptr + g * s_tg + tl.maximum(slot, 0) * s_ts
    dst = stack_ptr + (g * b + r) * MB
    for c0 in range(0, MB, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(src + c, mask=(c < MB) & valid, other=0)
        tl.store(dst + c, v, mask=c < MB)
    blk = tl.load(src + pos // block_size, mask=valid, other=0).to(tl.int64)
    row = tl.where(valid & (blk > 0), blk * block_size + pos % block_size, -1)
    tl.store(rows_ptr + g * b + r, row.to(tl.int32))
    if g == 0:
        tl.store(rix_ptr + r, tl.where(valid, r, -1))
        tl.store(lens_ptr + r, tl.where(valid, pos + 1, 0))
        tl.store(state_ptr + r, tl.where(valid, slot, spare))
        tl.store(rix32_ptr + r, tl.where(valid, r, -1).to(tl.int32))
        tl.store(slot32_ptr + r, slot.to(tl.int32))


def decode_inputs(
    pos: Tensor, slot: Tensor, table_stack: Tensor, block_size: int, spare: int
) -> DecodeInputs:
    """`decode_inputs_reference` in one launch (``table_stack`` contiguous)."""
    b = pos.shape[0]
    g, _, mb = table_stack.shape
    dev = pos.device
    stack = torch.empty((g, b, mb), dtype=table_stack.dtype, device=dev)
    rows = torch.empty((g, b), dtype=torch.int32, device=dev)
    rix = torch.empty(b, dtype=torch.int64, device=dev)
    lens = torch.empty(b, dtype=torch.int64, device=dev)
    state = torch.empty(b, dtype=torch.int64, device=dev)
    rix32 = torch.empty(b, dtype=torch.int32, device=dev)
    slot32 = torch.empty(b, dtype=torch.int32, device=dev)
    if b and g:
        _decode_inputs_kernel[(g, b)](
            pos.contiguous(), slot.contiguous(), table_stack, table_stack.stride(0),
            table_stack.stride(1), stack, rows, rix, lens, state, rix32, slot32, b, mb,
            block_size, spare,
            BLOCK=min(1024, triton.next_power_of_2(max(mb, 1))),
        )  # fmt: skip
    return DecodeInputs(rix, lens, stack, rows, state, rix32, slot32, rix32)


@triton.jit
def _step_counts_kernel(
    hm_ptr, s_g, s_r, bytes_ptr, out_ptr, G, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK)
    hits = tl.zeros([BLOCK], dtype=tl.int64)
    misses = tl.zeros([BLOCK], dtype=tl.int64)
    nbytes = tl.zeros([BLOCK], dtype=tl.int64)
    for g0 in range(0, G, BLOCK):
        gg = (g0 + g).to(tl.int64)
        m = gg < G
        h = tl.load(hm_ptr + gg * s_g + r * s_r, mask=m, other=0).to(tl.int64)
        x = tl.load(hm_ptr + gg * s_g + r * s_r + 1, mask=m, other=0).to(tl.int64)
        hits += h
        misses += x
        nbytes += x * tl.load(bytes_ptr + gg, mask=m, other=0)
    tl.store(out_ptr + r * 3, tl.sum(hits, axis=0))
    tl.store(out_ptr + r * 3 + 1, tl.sum(misses, axis=0))
    tl.store(out_ptr + r * 3 + 2, tl.sum(nbytes, axis=0))


def step_counts(hit_miss: Tensor, b: int, row_bytes: Tensor) -> Tensor:
    """`step_counts_reference` in one launch (``hit_miss [G, S, 2]``, last dim contiguous)."""
    g = hit_miss.shape[0]
    out = torch.empty((b, 3), dtype=torch.int64, device=hit_miss.device)
    if not g:
        return out.zero_()
    if b:
        _step_counts_kernel[(b,)](
            hit_miss, hit_miss.stride(0), hit_miss.stride(1), row_bytes.contiguous(), out, g,
            BLOCK=min(64, triton.next_power_of_2(g)),
        )  # fmt: skip
    return out
