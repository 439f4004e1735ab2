"""The Gluon sparse MLA kernel (`sparse_mla_gluon`, Hopper) against the reference at real sizes.

Runs on the GPU machine only. Same inputs and tolerances as ``test_attention_gpu.py``'s fp8
cases (the kernel dequantises rows to bf16 as the Triton wide kernel does), plus: the Gluon
output beside the Triton one, the dispatch's choice, a CUDA-graph replay, and a prefill chunk
past CUDA's grid and int32 limits (the Triton test's case, through this kernel).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from gpu_helpers import capture, poison_empty  # (tests/gpu is on sys.path under pytest)
from test_attention_gpu import LARGE_POOL_GIB, _pool, _spread_pool

from hisparse.attention import sparse_mla_decode, triton_split
from hisparse.attention import sparse_mla_gluon as smg
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference

if not smg.supported(torch.device("cuda")):  # pragma: no cover - not a Hopper GPU
    pytest.skip("the Gluon kernel is built for sm_90", allow_module_level=True)

DEV = torch.device("cuda")
C, R, H, K = 512, 64, 128, 2048
SCALE = 192**-0.5
FMT = "fp8_ds_mla"
TOKENS = 16


def _inputs(t: int, seed: int, kv: torch.Tensor, p_neg: float = 0.02):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEV).manual_seed(2000 + seed)
    rows = kv.shape[0] * kv.shape[1]
    idx = torch.randint(0, rows, (t, K), generator=g, device=DEV, dtype=torch.int32)
    idx[torch.rand(t, K, generator=g, device=DEV) < p_neg] = -1
    if t > 2:
        idx[1] = -1  # a token with no row
        idx[2, 7:] = -1  # a token with few rows
    ql = torch.randn(t, H, C, generator=g, device=DEV).bfloat16()
    qr = torch.randn(t, H, R, generator=g, device=DEV).bfloat16()
    return ql, qr, idx


def _check_against_reference(out, lse, ref_o, ref_l, few: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    assert torch.isfinite(out).all()
    many = ~few
    torch.testing.assert_close(out[many].float(), ref_o[many].float(), atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out[few].float(), ref_o[few].float(), atol=2e-2, rtol=1.6e-2)
    rel = (out.float() - ref_o.float()).norm() / ref_o.float().norm()
    assert rel < 1e-2, rel
    torch.testing.assert_close(lse, ref_l, atol=1.5e-2, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 3, 8, 29, 64, 256, 1024])
def test_gluon_real_sizes_against_reference_and_triton(t: int) -> None:
    """Decode batches and a prefill chunk; the null row holds NaN bytes (``-1`` entries must
    read nothing), outputs are NaN-poisoned first."""
    kv = _pool(FMT, 512, 64, t)
    kv[0, 0].fill_(0xFF)
    ql, qr, idx = _inputs(t, t, kv)
    idx[idx == 0] = 1  # row 0 only through -1 entries
    ref_o, ref_l = sparse_mla_decode_reference(ql, qr, kv, idx, SCALE, FMT)
    out, lse = smg.sparse_mla_decode_gluon(ql, qr, kv, idx, SCALE)
    torch.cuda.synchronize()
    few = torch.zeros(t, dtype=torch.bool, device=DEV)
    if t > 2:
        few[2] = True
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    _check_against_reference(out, lse, ref_o, ref_l, few)
    tri_o, tri_l = smt.sparse_mla_decode_triton(ql, qr, kv, idx, SCALE, FMT)
    # the same bf16 operands and fp32 sums, in another order
    torch.testing.assert_close(out.float(), tri_o.float(), atol=8e-3, rtol=1.6e-2)
    fin = torch.isfinite(tri_l)
    torch.testing.assert_close(lse[fin], tri_l[fin], atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 16, 40])
def test_gluon_split_counts(splits: int) -> None:
    """Partials and the combine; 40 splits of 2048 rows leave splits with no rows at all."""
    kv = _pool(FMT, 256, 64, 50 + splits)
    ql, qr, idx = _inputs(8, 50 + splits, kv)
    ref_o, ref_l = sparse_mla_decode_reference(ql, qr, kv, idx, SCALE, FMT)
    out, lse = smg.sparse_mla_decode_gluon(ql, qr, kv, idx, SCALE, num_splits=splits)
    few = torch.zeros(8, dtype=torch.bool, device=DEV)
    few[2] = True
    _check_against_reference(out, lse, ref_o, ref_l, few)


def test_gluon_token_major_view() -> None:
    """Rows through a strided view (a token stride of 3 rows, as a token-major host pool)."""
    base = _pool(FMT, 256, 3 * 64, 5)
    kv = base[:, ::3]
    ql, qr, idx = _inputs(16, 9, kv)
    ref_o, ref_l = sparse_mla_decode_reference(ql, qr, kv, idx, SCALE, FMT)
    out, lse = smg.sparse_mla_decode_gluon(ql, qr, kv, idx, SCALE)
    few = torch.zeros(16, dtype=torch.bool, device=DEV)
    few[2] = True
    _check_against_reference(out, lse, ref_o, ref_l, few)


def test_dispatch_picks_gluon_and_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 rows on sm_90 go to the Gluon kernel, one token as well as many (a row stride that
    is not 16-byte aligned, or ``HISPARSE_MLA_KERNEL=triton``: Triton), and a call replays
    in a CUDA graph."""
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    monkeypatch.delenv("HISPARSE_MLA_KERNEL", raising=False)
    kv = _pool(FMT, 128, 64, 3)
    ql, qr, idx = _inputs(TOKENS, 3, kv)
    calls: list[str] = []
    real_g, real_t = smg.sparse_mla_decode_gluon, smt.sparse_mla_decode_triton
    monkeypatch.setattr(smg, "sparse_mla_decode_gluon",
                        lambda *a, **k: calls.append("gluon") or real_g(*a, **k))  # fmt: skip
    monkeypatch.setattr(smt, "sparse_mla_decode_triton",
                        lambda *a, **k: calls.append("triton") or real_t(*a, **k))  # fmt: skip
    sparse_mla_decode(ql, qr, kv, idx, SCALE, FMT)
    monkeypatch.setenv("HISPARSE_MLA_KERNEL", "triton")
    sparse_mla_decode(ql, qr, kv, idx, SCALE, FMT)
    monkeypatch.delenv("HISPARSE_MLA_KERNEL")
    row = kv.shape[2]
    wide = torch.zeros(128 * 64, row + 4, dtype=torch.uint8, device=DEV)
    wide[:, :row] = kv.view(-1, row)
    sparse_mla_decode(ql, qr, wide.view(128, 64, row + 4)[:, :, :row], idx, SCALE, FMT)
    sparse_mla_decode(ql[:1], qr[:1], kv, idx[:1], SCALE, FMT)
    assert calls == ["gluon", "triton", "triton", "gluon"]

    graph, (g_out, g_lse) = capture(lambda: real_g(ql, qr, kv, idx, SCALE))
    _, _, idx2 = _inputs(TOKENS, 4, kv)
    idx.copy_(idx2)
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_l = sparse_mla_decode_reference(ql, qr, kv, idx, SCALE, FMT)
    few = torch.zeros(TOKENS, dtype=torch.bool, device=DEV)
    few[2] = True
    _check_against_reference(g_out, g_lse, ref_o, ref_l, few)


def test_gluon_large_prefill_chunk_past_grid_and_int32_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """70,000 query tokens (two launches over token slices), head-major q whose head offsets
    pass 2^31, rows past byte 2^32 of a 4.5 GiB pool; every output element written."""
    t, border = 70_000, triton_split.MAX_GRID_YZ
    kv, rows = _spread_pool(FMT, LARGE_POOL_GIB, 32768, seed=81)
    g = torch.Generator(device=DEV).manual_seed(82)
    idx = rows[torch.randint(0, rows.numel(), (t, K), generator=g, device=DEV)]
    idx[torch.rand(t, K, generator=g, device=DEV) < 0.02] = -1
    masked = [1, border, t - 1]
    idx[masked] = -1
    ql = torch.randn(H, t, C, generator=g, device=DEV, dtype=torch.bfloat16).transpose(0, 1)
    qr = torch.randn(t, H, R, generator=g, device=DEV, dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        poison_empty(m)
        out, lse = smg.sparse_mla_decode_gluon(ql, qr, kv, idx, SCALE)
        torch.cuda.synchronize()
    assert all(bool(torch.isfinite(part).all()) for part in out.split(8192))
    assert not bool(torch.isnan(lse).any())
    for i in masked:
        assert not bool(out[i].any()) and bool(torch.isneginf(lse[i]).all())
    picks = torch.randint(0, t, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    sample = sorted({0, 2, border - 1, border + 1, t - 2, *picks} - set(masked))
    s = torch.tensor(sample, device=DEV)
    ref_o, ref_l = sparse_mla_decode_reference(ql[s], qr[s], kv, idx[s], SCALE, FMT)
    few = torch.zeros(len(sample), dtype=torch.bool, device=DEV)
    _check_against_reference(out[s], lse[s], ref_o, ref_l, few)
