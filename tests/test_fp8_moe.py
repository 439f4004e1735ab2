"""The fp8 experts' grouped GEMM (`fp8_triton.grouped_gemm`, `fp8_moe`) against the W8A8
reference in Triton's CPU interpreter: fresh random pairs with empty experts, odd widths and
partial tiles, weight slices that start inside a scale tile, poisoned outputs; the alignment's
layout; the whole expert block against its per-expert reference; and the grouped path traced
for host reads (the fixed-shape decode step must not sync)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from hisparse.models import fp8
from hisparse.models.fp8_moe import Fp8Experts, block_rows, moe_align
from hisparse.runtime.ops.triton_common import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


def _ids(n: int, k: int, n_experts: int, used: int, g: torch.Generator) -> torch.Tensor:
    """``[n, k]`` distinct experts per token, drawn from the first ``used`` (others empty)."""
    rows = [torch.randperm(used, generator=g)[:k] for _ in range(n)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)


def _weights(e: int, n: int, k: int, g: torch.Generator, row_offset: int = 0):
    w = torch.randn(e, n + row_offset, k, generator=g) * 10.0 ** torch.randint(
        -2, 2, (e, 1, 1), generator=g
    )
    q, s = fp8.quantize_weight(w, pow2=True)
    return q[:, row_offset:].contiguous(), s


@pytest.mark.parametrize(
    ("n", "k", "e", "used", "bm"),
    [(1, 2, 8, 8, 16), (13, 3, 16, 5, 16), (40, 8, 64, 64, 32), (0, 2, 4, 4, 16)],
)
def test_moe_align_layout(n, k, e, used, bm) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(n + e)
    ids = _ids(n, k, e, used, g)
    slots, block_expert = moe_align(ids, e, bm)
    p = n * k
    assert slots.numel() == -(-(p + min(e, p) * (bm - 1)) // bm) * bm
    assert block_expert.numel() * bm == slots.numel()
    real = slots[slots < p]
    assert sorted(real.tolist()) == list(range(p))  # every pair exactly once
    flat = ids.reshape(-1)
    for b, ex in enumerate(block_expert.tolist()):
        block = slots[b * bm : (b + 1) * bm]
        if ex >= e:
            assert (block == p).all()
        else:
            assert (flat[block[block < p].long()] == ex).all()
    assert block_expert.tolist() == sorted(block_expert.tolist())


@pytest.mark.parametrize(
    ("n_tok", "k", "n_out", "width", "row_offset", "a_div"),
    [
        (5, 2, 130, 200, 0, 2),
        (9, 3, 50, 64, 37, 3),
        (3, 1, 257, 384, 0, 1),
        (17, 4, 96, 256, 64, 1),
    ],
)
def test_grouped_gemm_matches_reference(n_tok, k, n_out, width, row_offset, a_div) -> None:
    from hisparse.models import fp8_triton

    n_experts = 12
    g = torch.Generator().manual_seed(n_tok * 31 + n_out + row_offset)
    ids = _ids(n_tok, k, n_experts, 7, g)  # experts 7..11 get no pairs
    p = n_tok * k
    rows = p // a_div
    a = torch.randn(rows, width, generator=g) * 10.0 ** torch.randint(-3, 5, (rows, 1), generator=g)
    qa, sa = fp8.act_quant(a, pow2=True)
    qw, sw = _weights(n_experts, n_out, width, g, row_offset)
    flat = ids.reshape(-1)
    ref = fp8.grouped_block_gemm(qa, sa, flat, qw, sw, a_div=a_div, row_offset=row_offset)
    bm = block_rows(p, n_experts)
    slots, block_expert = moe_align(ids, n_experts, bm)
    dest = torch.full((p, n_out + 11), float("nan"))
    cols = dest[:, 5 : 5 + n_out]
    got = fp8_triton.grouped_gemm(
        qa, sa, slots, block_expert, bm, qw, sw, cols, a_div=a_div, row_offset=row_offset
    )
    assert torch.isfinite(got).all()
    assert ((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert torch.isnan(dest[:, :5]).all() and torch.isnan(dest[:, 5 + n_out :]).all()


def _experts(e: int, hidden: int, inter: int, g: torch.Generator) -> Fp8Experts:
    ex = Fp8Experts(e, hidden, inter, pow2=True)
    for name in ("gate", "up"):
        q, s = _weights(e, inter, hidden, g)
        getattr(ex, f"{name}_weight").data, getattr(ex, f"{name}_scale").data = q, s
    ex.down_weight.data, ex.down_scale.data = _weights(e, hidden, inter, g)
    return ex


def test_experts_grouped_equal_reference() -> None:
    """The whole expert block: the same terms, the GEMMs' fp32 sums in another order (an
    activation of the down projection may then round to the neighbouring e4m3 value)."""
    g = torch.Generator().manual_seed(4)
    ex = _experts(10, 192, 160, g)
    x = torch.randn(11, 192, generator=g)
    ids = _ids(11, 3, 10, 6, g)
    w = torch.rand(11, 3, generator=g)
    ref = ex.forward_reference(x, w, ids)
    got = ex.forward_grouped(x, w, ids)
    assert got.shape == (11, 192) and torch.isfinite(got).all()
    assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-3


class _HostReads(TorchDispatchMode):
    """Records aten ops that read a device value on the host or give data-dependent shapes."""

    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "item")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(s in name for s in self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_grouped_path_reads_nothing_back() -> None:
    """The alignment and the grouped path issue no op that syncs with the host or has a
    data-dependent shape (the reference path does, which the tracer must see)."""
    g = torch.Generator().manual_seed(6)
    ex = _experts(8, 128, 128, g)
    x = torch.randn(4, 128, generator=g)
    ids, w = _ids(4, 2, 8, 8, g), torch.rand(4, 2, generator=g)
    with _HostReads() as mode:
        ex.forward_grouped(x, w, ids)
    assert mode.seen == []
    with _HostReads() as mode:
        ex.forward_reference(x, w, ids)
    assert mode.seen
