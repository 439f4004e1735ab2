"""What the fused layer ops' tests share (CPU interpreter and CUDA): running an op under its
reference and under its kernel on copies of the same inputs, and what "the same MLA rows"
means when the RMS norm's sum order moves a latent value by an ulp."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hisparse.kv.row_formats import unpack_mla_rows

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
    lat_r, rope_r = unpack_mla_rows(row_format, flat[0][written])
    lat_g, rope_g = unpack_mla_rows(row_format, flat[1][written])
    assert torch.equal(rope_r, rope_g)
    step = 2**-3 if row_format == "fp8_ds_mla" else 2**-7
    torch.testing.assert_close(lat_g, lat_r, rtol=step, atol=lat_r.abs().amax().item() * 2**-9)
    assert (flat[0][written] != flat[1][written]).any(-1).float().mean() <= 0.25
