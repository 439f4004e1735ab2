"""What the fused layer ops' tests share (CPU interpreter and CUDA): running an op under its
reference and under its kernel on copies of the same inputs, and what "the same MLA rows"
means when the RMS norm's sum order moves a latent value by an ulp (and the keys' LayerNorm
an indexer key's e4m3 byte by a step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hisparse.kv.row_formats import IndexerCacheFormat, read_indexer_keys, unpack_mla_rows

if TYPE_CHECKING:
    import pytest


def copy_strided(a: torch.Tensor) -> torch.Tensor:
    """A copy with ``a``'s strides (``clone`` makes a strided slice contiguous)."""
    out = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    return out.copy_(a)


def reference_and_kernel(
    monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any], *args: Any
) -> list[tuple[Any, list[Any]]]:
    """``[(result, args)]`` of ``fn`` under ``HISPARSE_FUSED=reference``, then ``triton``,
    each on fresh copies of the tensor arguments (strides kept; written outputs come back in
    the copies)."""
    out = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("HISPARSE_FUSED", backend)
        copies = [copy_strided(a) if isinstance(a, torch.Tensor) else a for a in args]
        out.append((fn(*copies), copies))
    return out


def assert_mla_rows_match(
    ref: torch.Tensor, got: torch.Tensor, view: torch.Tensor, slots: torch.Tensor, row_format: str
) -> None:
    """Rows written at ``slots`` (``>= 0``): rope bytes equal, latent within one step of the
    row format; every other row of both views equal to the original ``view``."""
    flat = [t.flatten(0, 1) for t in (ref, got, view)]
    written = slots[slots >= 0].long()
    untouched = torch.ones(flat[0].shape[0], dtype=torch.bool, device=ref.device)
    untouched[written] = False
    assert torch.equal(flat[0][untouched], flat[2][untouched])
    assert torch.equal(flat[1][untouched], flat[2][untouched])
    if written.numel() == 0:  # every slot skipped: nothing was to be written
        return
    lat_r, rope_r = unpack_mla_rows(row_format, flat[0][written])
    lat_g, rope_g = unpack_mla_rows(row_format, flat[1][written])
    assert torch.equal(rope_r, rope_g)
    step = 2**-3 if row_format == "fp8_ds_mla" else 2**-7
    torch.testing.assert_close(lat_g, lat_r, rtol=step, atol=lat_r.abs().amax().item() * 2**-9)
    assert (flat[0][written] != flat[1][written]).any(-1).float().mean() <= 0.25


def assert_indexer_keys_close(
    ref: torch.Tensor,
    got: torch.Tensor,
    before: torch.Tensor,
    fmt: IndexerCacheFormat,
    slots: torch.Tensor,
) -> None:
    """fp8 indexer pages ``got`` as the reference wrote ``ref`` from ``before``: the same
    power-of-two scales (all but a rare tile), keys within an e4m3 step and what a normed
    value's ulp moves them by (a LayerNorm computed in another order), most bytes equal, and
    every other byte of the pages untouched."""
    bs = ref.shape[1] // fmt.row_bytes
    d, ns = fmt.head_dim, fmt.head_dim // fmt.tile
    rows = slots[slots >= 0]
    if rows.numel() == 0:
        assert torch.equal(got, before)
        return
    kr, sr = read_indexer_keys(ref, fmt, rows)
    kg, sg = read_indexer_keys(got, fmt, rows)
    assert sr is not None and sg is not None
    # power-of-two scales: equal but where a normed ulp moved a tile's amax across a power
    # of two (rare); the values are compared dequantised either way
    assert (sr != sg).float().mean() <= 1e-3
    a = (kr.float().view(*kr.shape[:-1], -1, fmt.tile) * sr[..., None]).flatten(-2)
    b = (kg.float().view(*kg.shape[:-1], -1, fmt.tile) * sg[..., None]).flatten(-2)
    # One e4m3 step, plus what an ulp of a few normed values moves a Hadamard output by
    # (small outputs have fine steps: that shift can be several of them).
    bound = a.abs() * 2**-3 + 2**-6 * a.abs().amax(-1, keepdim=True)
    assert ((a - b).abs() <= bound).all()
    assert (kr.view(torch.uint8) == kg.view(torch.uint8)).float().mean() > 0.9
    untouched = torch.ones_like(before, dtype=torch.bool)
    for s in rows.tolist():
        blk, off = divmod(s, bs)
        untouched[blk, off * d : (off + 1) * d] = False
        sc = bs * d + off * 4 * ns
        untouched[blk, sc : sc + 4 * ns] = False
    assert torch.equal(got[untouched], before[untouched])
