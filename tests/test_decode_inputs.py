"""The fixed-shape decode step's inputs (`hisparse.engine.decode_inputs`): the Triton kernel
(CPU interpreter) against the torch composition, outputs compared whole."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.engine.decode_inputs import decode_inputs, decode_inputs_reference

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


@pytest.mark.parametrize("b,groups,mb", [(1, 1, 8), (29, 3, 2048), (64, 4, 37)])
def test_kernel_equals_the_torch_composition(monkeypatch, b: int, groups: int, mb: int) -> None:
    g = torch.Generator().manual_seed(b + groups)
    slots, bs = b + 6, 64
    table = torch.randint(0, 900, (groups, slots + 1, mb), generator=g, dtype=torch.int32)
    table[torch.rand(table.shape, generator=g) < 0.2] = 0  # pages not (yet) there
    pos = torch.randint(0, mb * bs, (b,), generator=g)
    slot = torch.randperm(slots, generator=g)[:b]
    slot[1::3] = -1  # padding rows (their positions are arbitrary)
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    got = decode_inputs(pos, slot, table, bs, slots)
    want = decode_inputs_reference(pos, slot, table, bs, slots)
    for name in want.__dataclass_fields__:
        a, w = getattr(got, name), getattr(want, name)
        assert a.dtype == w.dtype and torch.equal(a, w), name
    if b > 1:  # both kinds of rows were exercised
        assert (want.rows >= 0).any() and (want.rows == -1).any()


@pytest.mark.parametrize("b,groups", [(1, 1), (29, 4), (64, 61), (7, 100)])
def test_step_counts_kernel_equals_the_torch_composition(monkeypatch, b: int, groups: int):
    """A decode step's per-request hits, misses and bytes from every group's counts: the
    kernel (more groups than one block, rows past ``b`` ignored) against the torch sums."""
    from hisparse.engine.decode_inputs import step_counts, step_counts_reference

    g = torch.Generator().manual_seed(b * groups)
    hm = torch.randint(0, 5000, (groups, b + 3, 2), generator=g, dtype=torch.int32)
    row_bytes = torch.randint(600, 70_000, (groups,), generator=g)
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    got = step_counts(hm, b, row_bytes)
    want = step_counts_reference(hm, b, row_bytes)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(want[:, 1], hm[:, :b, 1].long().sum(0))


def test_verify_rows_are_one_row_decodes_of_their_request():
    """``rows`` = 3 per request (a verify step): each row's fields are those of a one-row
    step at its position with its request's slot (padding rows: slot -1), and the runtime's
    ``request_of_row`` names the request (``-1`` for padding rows)."""
    bs, slots = 4, 5
    table = torch.arange(2 * (slots + 1) * 6, dtype=torch.int32).view(2, slots + 1, 6) + 1
    # request 0 (slot 2): 3 rows at 9..11; request 1 (slot 0): 2 rows, then a padding row
    pos = torch.tensor([9, 10, 11, 5, 6, 0])
    slot = torch.tensor([2, 2, 2, 0, 0, -1])
    got = decode_inputs_reference(pos, slot, table, bs, slots, rows=3)
    one = decode_inputs_reference(pos, slot, table, bs, slots)
    for name in ("req_index", "seq_lens", "stack", "rows", "state_slots", "slot_i32"):
        assert torch.equal(getattr(got, name), getattr(one, name)), name
    assert got.request_of_row.tolist() == [0, 0, 0, 1, 1, -1]
    assert got.seq_lens.tolist() == [10, 11, 12, 6, 7, 0]
