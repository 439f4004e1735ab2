"""The W8A8 block-fp8 kernels (`hisparse.models.fp8_triton`) against their reference
(`hisparse.models.fp8`) in Triton's CPU interpreter: fresh random inputs with values far
beyond ±448, odd shapes and partial tiles, weight slices that start inside a scale tile,
outputs poisoned first (the whole destination is compared, so a stray write shows)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.models import fp8
from hisparse.runtime.ops.triton_common import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


def _kernels():  # imported after TRITON_INTERPRET is set
    from hisparse.models import fp8_triton

    return fp8_triton


def _activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 .. 1e4: far beyond ±448), a zero row."""
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 5, (m, 1), generator=g)
    if m > 2:
        x[1] = 0.0
    return x


def _weight(n: int, k: int, g: torch.Generator, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-2, 2, (n, 1), generator=g)
    return fp8.quantize_weight(w, pow2)


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to fp32 rounding: relative error at most 1e-5 of the result's scale."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.isfinite(got).all()
    scale = ref.abs().amax().clamp(min=1e-30)
    assert ((got.float() - ref.float()).abs() / scale).max() <= 1e-5


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(("m", "k"), [(1, 128), (5, 200), (9, 384), (3, 7)])
def test_act_quant_is_bit_exact(pow2, m, k) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + pow2)
    x = _activations(m, k + 24, g)[:, :k]  # strided rows
    q_ref, s_ref = fp8.act_quant(x, pow2)
    q, s = _kernels().act_quant(x, pow2)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.contiguous().view(torch.uint8))
    assert q.float().abs().max() <= fp8.FP8_MAX
    if pow2:
        assert torch.equal(s, fp8.ceil_pow2(s))


@pytest.mark.parametrize("bf16_in", [False, True])
def test_act_quant_of_bf16_rows(bf16_in) -> None:
    g = torch.Generator().manual_seed(3)
    x = _activations(6, 256, g).to(torch.bfloat16 if bf16_in else torch.float32)
    q_ref, s_ref = fp8.act_quant(x, True)
    q, s = _kernels().act_quant(x, True)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize(
    ("m", "n", "k", "row_offset"),
    [(1, 130, 256, 0), (3, 50, 200, 37), (17, 257, 384, 0), (33, 64, 96, 100), (2, 1, 128, 5)],
)
@pytest.mark.parametrize("pow2", [False, True])
def test_block_gemm_matches_reference(m, n, k, row_offset, pow2) -> None:
    g = torch.Generator().manual_seed(m + 7 * n + 13 * k + row_offset + pow2)
    qx, sx = fp8.act_quant(_activations(m, k, g), pow2)
    qw, sw_full = _weight(n + row_offset, k, g, pow2)
    # a slice of the weight starting row_offset rows into its first scale tile, as a
    # tensor-parallel rank keeps it
    qw = qw[row_offset:].contiguous()
    sw = sw_full[row_offset // fp8.BLOCK :].contiguous()
    ref = fp8.block_gemm(qx, sx, qw, sw, row_offset)
    # poisoned destination, wider than the result: only [m, n] may be written
    dest = torch.full((m, n + 9), float("nan"))
    got = _kernels().block_gemm(qx, sx, qw, sw, row_offset, out=dest[:, 3 : 3 + n])
    assert_fp32_close(got, ref)
    assert torch.isnan(dest[:, :3]).all() and torch.isnan(dest[:, 3 + n :]).all()


def test_block_gemm_reference_is_w8a8() -> None:
    """The reference against a plain fp64 computation of the same W8A8 definition."""
    g = torch.Generator().manual_seed(11)
    x = _activations(4, 300, g)
    qw, sw = _weight(140, 300, g, True)
    qx, sx = fp8.act_quant(x, True)
    deq_x = qx.double().view(4, -1) * sx.double().repeat_interleave(128, 1)[:, :300]
    deq_w = fp8.dequantize(qw, sw).double()
    want = deq_x @ deq_w.t()
    got = fp8.w8a8_linear(x, qw, sw, pow2=True)
    assert ((got.double() - want).abs().max() / want.abs().max()) <= 1e-6


def test_block_gemm_bf16_output_rounds_once() -> None:
    g = torch.Generator().manual_seed(5)
    qx, sx = fp8.act_quant(_activations(7, 256, g).bfloat16())
    qw, sw = _weight(96, 256, g, False)
    ref = fp8.block_gemm(qx, sx, qw, sw, out_dtype=torch.float32)
    got = _kernels().block_gemm(qx, sx, qw, sw, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # one rounding of an fp32 result within 1e-5 of the reference: at most one bf16 step
    torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=ref.abs().max().item() * 1e-5)


def test_dequantize_and_quantize_weight_round_trip() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 200, 130, generator=g)
    q, s = fp8.quantize_weight(w, pow2=True)
    assert q.shape == w.shape and s.shape == (3, 2, 2)
    assert torch.equal(s, fp8.ceil_pow2(s))
    back = fp8.dequantize(q, s)
    assert ((back - w).abs() <= s.repeat_interleave(128, 1)[:, :200].repeat_interleave(
        128, 2)[..., :130] * 16).all()  # fmt: skip
    assert torch.equal(fp8.quantize_weight(back, pow2=True)[0].view(torch.uint8),
                       q.view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("row_offset", [0, 40])
def test_fp8_linear_triton_equals_reference(monkeypatch, row_offset) -> None:
    """The module's dispatch: ``HISPARSE_FP8_GEMM=triton`` (the interpreter) against the
    reference the CPU runs by default, on a 3-D input."""
    from hisparse.models.fp8_linear import Fp8Linear, gemm_backend, kernels_used

    g = torch.Generator().manual_seed(row_offset)
    lin = Fp8Linear(200, 70, row_offset=row_offset, pow2=True)
    qw, sw = _weight(70 + row_offset, 200, g, True)
    lin.weight.data = qw[row_offset:].contiguous()
    lin.weight_scale_inv.data = sw
    x = _activations(6, 200, g).view(2, 3, 200)
    assert gemm_backend(x.device) == "reference"
    ref = lin(x)
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "triton")
    got = lin(x)
    assert got.shape == (2, 3, 70)
    assert_fp32_close(got, ref)
    assert any("Triton" in k for k in kernels_used())
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "bogus")
    with pytest.raises(ValueError, match="HISPARSE_FP8_GEMM"):
        lin(x)
