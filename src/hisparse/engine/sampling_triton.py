"""The greedy token of each row of a step's logits in one or two launches (CUDA).

``torch.argmax`` over ``[B, V]`` logits reduces each row within one thread block, and its
launch heuristics put several rows in a block, so a decode batch leaves most SMs idle (and
the sampler copied bf16 logits to fp32 first; docs/benchmarks.md §16). Here each row is cut
into chunks, one program each; a program keeps the best of its chunk and, when a row has
several chunks, a second launch merges them in chunk order.

The result is ``torch.argmax(logits.float(), -1)`` exactly, for bf16, fp16 and fp32 logits
(their cast to fp32 is exact and keeps the order): the largest value, NaN above every number,
``-0.0`` equal to ``0.0``, the first index among equals. A value is compared through an int32
key that orders floats as numbers (NaN: the largest key), so equality is the key's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hisparse.attention.triton_split import num_sms
from hisparse.runtime.ops import triton_common  # noqa: F401  (the interpreter's loop-bound fix)

#: Logits a program reads per iteration, and per chunk at most (a row longer than one chunk
#: gets several programs, as many as fill the SMs twice over).
BLOCK = 2048
MAX_CHUNK = 16384
INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _ordered_keys(x):
    """int32 keys whose order is the values' (NaN the largest, ``-0.0`` equal to ``0.0``)."""
    x = x.to(tl.float32) + 0.0  # -0.0 + 0.0 = +0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, INT32_MAX, key)


@triton.jit
def _chunk_best_kernel(
    x_ptr, s_row, V, chunk, chunks, key_ptr, idx_ptr, out_ptr,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, c): the largest key of the row's chunk ``c`` and its first index; the
    index itself to ``out`` when the row has one chunk, else both to the per-chunk arrays."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * chunk
    stop = tl.minimum(start + chunk, V)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -(2**31), tl.int32)
    best_i = tl.full((BLOCK,), 2**31 - 1, tl.int32)
    for i0 in range(start, stop, BLOCK):
        i = i0 + offs
        key = _ordered_keys(tl.load(x_ptr + row * s_row + i, mask=i < stop, other=float("-inf")))
        key = tl.where(i < stop, key, -(2**31))
        take = key > best  # a later iteration wins a lane only when strictly larger
        best = tl.where(take, key, best)
        best_i = tl.where(take, i, best_i)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_i, 2**31 - 1), axis=0)
    if SPLIT:
        tl.store(key_ptr + row * chunks + c, top)
        tl.store(idx_ptr + row * chunks + c, first)
    else:
        tl.store(out_ptr + row, first.to(tl.int64))


@triton.jit
def _merge_chunks_kernel(key_ptr, idx_ptr, out_ptr, chunks, BC: tl.constexpr):
    """A row's chunks in order: the largest key, the first chunk holding it (its index)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    key = tl.load(key_ptr + row * chunks + c, mask=c < chunks, other=-(2**31))
    idx = tl.load(idx_ptr + row * chunks + c, mask=c < chunks, other=2**31 - 1)
    top = tl.max(key, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(key == top, idx, 2**31 - 1), axis=0).to(tl.int64))


def chunks_for(rows: int, vocab: int, sms: int) -> int:
    """Chunks per row: one up to `MAX_CHUNK` logits, else enough for twice the SMs'
    programs, none longer than `MAX_CHUNK`."""
    if vocab <= MAX_CHUNK:
        return 1
    want = max(1, triton.cdiv(2 * sms, max(rows, 1)))
    return max(triton.cdiv(vocab, MAX_CHUNK), min(want, triton.cdiv(vocab, BLOCK)))


def argmax_rows(logits: Tensor, chunks: int | None = None) -> Tensor:
    """``torch.argmax(logits.float(), dim=-1)`` of ``logits [B, V]`` (unit stride on V), int64
    ``[B]``; ``chunks``: programs per row (default `chunks_for`)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows: rows of no logits")
    if chunks is None:
        chunks = chunks_for(rows, vocab, num_sms(logits.device))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK) * BLOCK
    chunks = triton.cdiv(vocab, chunk)
    keys = idx = out
    if chunks > 1:
        keys = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
        idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(rows, chunks)](
        logits, logits.stride(0), vocab, chunk, chunks, keys, idx, out, SPLIT=chunks > 1,
        BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    if chunks > 1:
        bc = max(2, triton.next_power_of_2(chunks))
        _merge_chunks_kernel[(rows,)](keys, idx, out, chunks, BC=bc, num_warps=1)
    return out
