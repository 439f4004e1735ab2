"""The replay's fused hash kernel equals its torch form (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported; outputs are poisoned
first, keys, lengths and columns drawn fresh (negative columns included: the replay hashes
``-1`` entries of a previous selection before masking them).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from hisparse.bench import replay_triton
from hisparse.bench.replay import hash_rows, row_bases
from hisparse.bench.replay_triton import replay_hash_triton

pytestmark = pytest.mark.skipif(
    not isinstance(replay_triton._replay_hash_kernel, InterpretedFunction),
    reason="the kernel module was imported before TRITON_INTERPRET was set",
)


@pytest.mark.parametrize(("rows", "n", "two_d"), [(1, 7, False), (5, 1500, True), (3, 2047, False)])
def test_fused_hash_equals_torch(rows, n, two_d):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    keys = torch.randint(0, 2**31 - 1, (rows,), generator=g)
    lens = torch.randint(1, 1 << 21, (rows,), generator=g)
    cols = torch.randint(-1, 1 << 21, (rows, n) if two_d else (n,), generator=g)
    for seed, salt in ((0, 0), (12345, 7)):
        out = torch.full((rows, n), -7777, dtype=torch.int64)
        got = replay_hash_triton(seed, salt, keys, lens, cols, out=out)
        want = hash_rows(row_bases(seed, salt, keys, lens), cols)
        assert got is out
        assert torch.equal(got, want)
        assert int(got.min()) >= 0 and int(got.max()) < 2**31
