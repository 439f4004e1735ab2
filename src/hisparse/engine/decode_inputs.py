"""A fixed-shape decode step's per-row inputs from the persistent block tables: one op on CUDA.

Why: the padded decode step (`ModelRunner._static_step`, the body of its CUDA graphs) derived
its rows' request index, key counts, table rows and new-token rows with two dozen small torch
ops per step. `decode_inputs` computes them in one Triton launch on CUDA (``HISPARSE_FUSED``,
`hisparse.models.fused.fused_on`); `decode_inputs_reference` is the torch composition it
replaces, and the CPU path. Integer arithmetic only: both give the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DecodeInputs:
    """Per padded row ``r`` of a decode batch (padding: slot ``< 0``)."""

    #: ``[b]`` int64: ``r``, or ``-1`` for padding.
    req_index: Tensor
    #: ``[b]`` int64: keys after this step (``pos + 1``), ``0`` for padding.
    seq_lens: Tensor
    #: ``[G, b, MB]`` int32: each table's row of the request (zeros for padding).
    stack: Tensor
    #: ``[G, b]`` int32: the new token's row in each table (``-1``: padding or no page).
    rows: Tensor
    #: ``[b]`` int64: the state slot each row reads and writes (padding: ``spare``).
    state_slots: Tensor
    #: ``[b]`` int32 copies of ``req_index`` and of the slots as given (the runtime's types).
    req_index_i32: Tensor
    slot_i32: Tensor
    #: ``[b]`` int32: the request of each row for the runtime (``rows`` rows per request:
    #: ``r // rows``; ``-1`` for padding); ``req_index_i32`` where ``rows`` is 1.
    request_of_row: Tensor


def decode_inputs_reference(
    pos: Tensor, slot: Tensor, table_stack: Tensor, block_size: int, spare: int, rows: int = 1
) -> DecodeInputs:
    """The torch composition: ``pos``/``slot`` ``[b]`` int64, ``table_stack [G, S, MB]``.

    ``rows`` > 1: a verify step's rows, ``rows`` consecutive ones per request (its last
    token, then its drafts, then padding rows of slot ``-1``). Every per-row field is then
    the one-row step's for that row alone (its own length ``pos + 1``, its request's table
    row): the model sees each row as a one-row decode; ``request_of_row`` tells the runtime
    which request each row belongs to."""
    b, dev, bs = pos.shape[0], pos.device, block_size
    valid = slot >= 0
    rix = torch.where(valid, torch.arange(b, device=dev), -1)
    seq_lens = torch.where(valid, pos + 1, 0)
    gslot = slot.clamp_min(0)
    # Every persistent table's rows of this batch and the new token's row in each, with one
    # op apiece for all tables (both placements: HiSparse has a table per layer group).
    stack = torch.where(valid[None, :, None], table_stack.index_select(1, gslot), 0)
    page = (pos // bs).view(1, b, 1).expand(stack.shape[0], b, 1)
    blk = stack.gather(2, page)[..., 0].long()
    new_rows = torch.where(valid & (blk > 0), blk * bs + pos % bs, -1).to(torch.int32)
    state = torch.where(valid, slot, spare)
    rix32 = rix.to(torch.int32)
    owner = rix32 if rows == 1 else torch.where(valid, rix // rows, -1).to(torch.int32)
    return DecodeInputs(rix, seq_lens, stack, new_rows, state, rix32, slot.to(torch.int32), owner)


def decode_inputs(
    pos: Tensor, slot: Tensor, table_stack: Tensor, block_size: int, spare: int, rows: int = 1
) -> DecodeInputs:
    """`decode_inputs_reference`'s values; one Triton launch where the fused ops run (one
    row per request; a verify step's rows take the torch composition)."""
    from hisparse.models.fused import fused_on

    if rows == 1 and fused_on(pos) and table_stack.is_contiguous():
        from hisparse.engine import decode_inputs_triton

        return decode_inputs_triton.decode_inputs(pos, slot, table_stack, block_size, spare)
    return decode_inputs_reference(pos, slot, table_stack, block_size, spare, rows)


def step_counts_reference(hit_miss: Tensor, b: int, row_bytes: Tensor) -> Tensor:
    """Per request of a decode step, ``[b, 3]`` int64: hits and misses summed over the index
    groups and the bytes the misses moved, from the groups' ``hit_miss [G, S, 2]`` (int32)
    and each group's bytes per missed row ``row_bytes [G]``."""
    hm = hit_miss[:, :b].long()
    misses = hm[..., 1]
    nbytes = (misses * row_bytes[:, None]).sum(0)
    return torch.stack((hm[..., 0].sum(0), misses.sum(0), nbytes), dim=1)


def step_counts(hit_miss: Tensor, b: int, row_bytes: Tensor) -> Tensor:
    """`step_counts_reference`'s values; one Triton launch where the fused ops run (instead
    of a stack, a cast, a product, three sums and a stack per step)."""
    from hisparse.models.fused import fused_on

    if fused_on(hit_miss) and hit_miss.stride(2) == 1:
        from hisparse.engine import decode_inputs_triton

        return decode_inputs_triton.step_counts(hit_miss, b, row_bytes)
    return step_counts_reference(hit_miss, b, row_bytes)
