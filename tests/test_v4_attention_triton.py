"""The Triton DeepSeek-V4 attention kernel equals its reference (`v4_attention_paged_reference`)
on fresh random inputs under TRITON_INTERPRET=1: window rows and entries at their columns of
a pool whose other values are NaN, masked rows, a token with no row (the sink alone), more
heads than one program's block, and V4-Flash's shape (64 heads of 512)."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.v4_attention_reference import (
    v4_attention_paged_reference,
    v4_attention_reference,
    v4_paged_rows,
)

pytest.importorskip("triton")
from hisparse.attention.v4_attention_triton import v4_attention_triton


def _case(n, h, d, n_window, n_entries, dtype, seed, blocks=9, bs=4):
    g = torch.Generator().manual_seed(seed)
    entry_col = d
    pool = torch.full((blocks, bs, 2 * d + 16), float("nan"))
    pool[:, :, : 2 * d] = torch.randn(blocks, bs, 2 * d, generator=g)
    pool = pool.to(dtype)
    q = torch.randn(n, h, d, generator=g).to(dtype)
    k = n_window + n_entries
    idx = torch.randint(0, blocks * bs, (n, k), generator=g, dtype=torch.int32)
    idx[torch.rand(n, k, generator=g) < 0.3] = -1
    idx[0] = -1  # the first token reads no row: the sink alone
    sinks = torch.randn(h, generator=g)
    return q, pool, idx, n_window, entry_col, sinks, d**-0.5


@pytest.mark.parametrize(
    ("n", "h", "d", "n_window", "n_entries", "dtype", "tol", "splits"),
    [
        (5, 4, 32, 8, 7, torch.float32, 1e-5, None),
        (3, 20, 64, 40, 90, torch.float32, 1e-5, 3),  # splits of 64 rows, one ends early
        (3, 20, 64, 40, 3, torch.float32, 1e-5, 1),
        (3, 6, 32, 8, 0, torch.bfloat16, 2e-2, None),
        (2, 64, 512, 8, 6, torch.float32, 1e-4, None),
    ],
)
def test_kernel_equals_reference(n, h, d, n_window, n_entries, dtype, tol, splits):
    """``splits``: flash-decoding over the rows (None: the kernel's own choice)."""
    q, pool, idx, nw, col, sinks, scale = _case(n, h, d, n_window, n_entries, dtype, seed=n + h)
    want = v4_attention_paged_reference(q, pool, idx, nw, col, sinks, scale)
    out = torch.full_like(q, float("nan"))
    got = v4_attention_triton(q, pool, idx, nw, col, sinks, scale, out=out, num_splits=splits)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert got[0].abs().max() == 0  # only the sink: zero rows


def test_paged_reference_reads_the_columns():
    """The paged reference is the gathered one on the rows it names."""
    q, pool, idx, nw, col, sinks, scale = _case(4, 4, 32, 8, 5, torch.float32, seed=1)
    rows, valid = v4_paged_rows(pool, idx, nw, col, 32)
    bs = pool.shape[1]
    r = int(idx[1, nw])
    if r >= 0:
        torch.testing.assert_close(rows[1, nw], pool[r // bs, r % bs, col : col + 32])
    want = v4_attention_reference(q, rows, valid, sinks, scale)
    got = v4_attention_paged_reference(q, pool, idx, nw, col, sinks, scale)
    torch.testing.assert_close(got, want)
