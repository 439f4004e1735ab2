"""Triton sparse GQA decode equals the reference (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported. Every case draws fresh
random K/V rows in the real GQA row format (`GqaRowFormat.pack`: K then V of every KV head),
queries and indices (with ``-1`` entries and an all-masked token), reads the rows through a
strided (token-interleaved) view of the pool filled with random garbage bytes, and checks that
NaN-poisoned outputs are fully written.

Tolerances: under the interpreter the kernel's dots run in fp32, so against the fp32 reference
it differs by summation order only (abs/rel 1e-5). bf16 queries give a bf16 output; the
interpreter's bf16 cast truncates (one bf16 ulp, 2^-7 relative) where torch rounds to nearest,
hence abs 1e-3 / rel 1.6e-2 there. ``lse`` is fp32 in both: 1e-5.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import sparse_gqa_triton as sgt
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention.sparse_gqa_reference import (
    GqaRowFormat,
    sparse_gqa_decode,
    sparse_gqa_reference,
)

pytestmark = pytest.mark.skipif(
    not smt.interpreting(), reason="Triton kernels were defined outside the interpreter"
)

G, D = 3, 64  # SmolLM2's KV heads and head dim


def _pool(fmt: GqaRowFormat, nb: int, bs: int, g: torch.Generator) -> torch.Tensor:
    """A ``[nb, bs, row_bytes]`` view with a token stride of two rows over garbage bytes."""
    k = torch.randn(nb * bs, fmt.num_kv_heads, fmt.head_dim, generator=g) * 2
    v = torch.randn(nb * bs, fmt.num_kv_heads, fmt.head_dim, generator=g)
    rows = fmt.pack(k, v).view(nb, bs, -1)
    big = torch.randint(0, 255, (nb, 2 * bs, fmt.row_bytes), generator=g, dtype=torch.uint8)
    big[:, ::2] = rows
    return big[:, ::2]


def _indices(t: int, k: int, rows: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.randperm(rows, generator=g)[:k].repeat(t, 1).to(torch.int32)
    idx = idx[:, torch.randperm(k, generator=g)]
    idx[torch.rand(t, k, generator=g) < 0.25] = -1
    if t > 1:
        idx[t - 1] = -1  # an all-masked token: out 0, lse -inf
    return idx


def _run(rows: str, t: int, h: int, k: int, dtype: torch.dtype, seed: int, d: int = D,
         **kw) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    fmt = GqaRowFormat(G, d, rows)
    nb, bs = 6, 8
    kv = _pool(fmt, nb, bs, g)
    idx = _indices(t, k, nb * bs, g)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    scale = d**-0.5
    ref_o, ref_l = sparse_gqa_reference(q, kv, idx, scale, fmt)
    out, lse = sgt.sparse_gqa_decode_triton(q, kv, idx, scale, fmt, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref_o.float(), **tol)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)
    if t > 1:
        assert torch.equal(out[t - 1], torch.zeros_like(out[t - 1]))
        assert torch.isneginf(lse[t - 1]).all()


@pytest.mark.parametrize("rows", ["bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(rows: str, dtype: torch.dtype, splits: int) -> None:
    seed = 10 * (rows == "bf16") + 5 * (dtype == torch.bfloat16) + splits
    cfg = sgt.GqaDecodeConfig(block_n=8)
    _run(rows, 3, 9, 40, dtype, seed, num_splits=splits, config=cfg)


@pytest.mark.parametrize("seed", range(3))
def test_decode_random_shapes(seed: int) -> None:
    """Random token counts, group sizes (1..5 query heads per KV head), top-k and head dims;
    default tile shape and split count (indices and heads padded and masked in the kernel)."""
    g = torch.Generator().manual_seed(500 + seed)
    t = int(torch.randint(1, 4, (1,), generator=g))
    group = int(torch.randint(1, 6, (1,), generator=g))
    k = int(torch.randint(1, 48, (1,), generator=g))
    d = [16, 32, 64][seed]
    _run(["bf16", "fp32", "fp16"][seed], t, G * group, k, torch.float32, seed, d=d)


def test_more_splits_than_tiles_gives_empty_splits() -> None:
    """A split past the last index contributes nothing (lse -inf), not NaN."""
    _run("bf16", 2, 9, 9, torch.float32, 77, num_splits=4, config=sgt.GqaDecodeConfig(8))


def test_poisoned_outputs_are_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element of out / lse is written, also through the combine step (NaN-filled
    allocations: an unwritten element would fail the comparison)."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    for splits in (1, 2):
        _run("bf16", 3, 9, 24, torch.float32, 90 + splits, num_splits=splits,
             config=sgt.GqaDecodeConfig(8))  # fmt: skip


def test_fp16_rows_and_queries() -> None:
    _run("fp16", 2, 6, 20, torch.float16, 31, config=sgt.GqaDecodeConfig(8))


def test_dispatch_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(sgt, "sparse_gqa_decode_triton", lambda *a, **k: calls.append(1))
    g = torch.Generator().manual_seed(3)
    fmt = GqaRowFormat(G, D, "bf16")
    kv = _pool(fmt, 2, 8, g)
    q = torch.randn(1, 9, D, generator=g)
    idx = torch.arange(8, dtype=torch.int32)[None]
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    out, _ = sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)
    assert not calls and out.shape == (1, 9, D)
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)
    assert calls == [1]
    # A head dim that is not a power of two is not a kernel shape: reference even when forced.
    odd = GqaRowFormat(G, 24, "bf16")
    sparse_gqa_decode(torch.randn(1, 9, 24), _pool(odd, 2, 8, g), idx, 0.2, odd)
    assert calls == [1]
    monkeypatch.setenv("HISPARSE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="HISPARSE_ATTENTION"):
        sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)


def test_rejects_unsupported_inputs() -> None:
    fmt = GqaRowFormat(G, D, "bf16")
    kv = torch.zeros(2, 8, fmt.row_bytes, dtype=torch.uint8)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="Triton sparse GQA"):
        sgt.sparse_gqa_decode_triton(torch.zeros(1, 8, D), kv, idx, 0.1, fmt)  # 8 % 3 heads
    with pytest.raises(ValueError, match="shapes disagree"):
        sgt.sparse_gqa_decode_triton(torch.zeros(2, 9, D), kv, idx, 0.1, fmt)
