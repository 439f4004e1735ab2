"""Triton sparse MLA decode equals the reference (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported. Every case draws fresh
random rows, queries and indices (with ``-1`` entries and an all-masked token) and reads the
rows through a strided (token-interleaved) view of the pool; outputs are checked to be fully
written (NaN-poisoned allocations).

Tolerances: under the interpreter the kernel's dots run in fp32 (the interpreter's bf16 dot
is wrong), so with fp32 queries it differs from the fp32 reference by summation order only
(abs/rel 1e-5). With bf16 queries the output is stored as bf16; the interpreter's bf16 cast
truncates (up to one bf16 ulp, 2^-7 relative) where torch rounds to nearest, so those cases
use the field's bf16 bar, abs 1e-3 / rel 1.6e-2. ``lse`` is fp32 in both: 1e-5.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import sparse_mla_decode, triton_split
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference
from hisparse.kv.row_formats import pack_mla_rows

pytestmark = pytest.mark.skipif(
    not smt.interpreting(), reason="Triton kernels were defined outside the interpreter"
)

C, R = 512, 64
SCALE = 192**-0.5


def _pool(fmt: str, nb: int, bs: int, g: torch.Generator, pad: int = 0) -> torch.Tensor:
    """A ``[nb, bs, row_bytes]`` view with a token stride of two rows (any strides allowed);
    ``pad`` bytes after each row (row strides that are not multiples of 16 bytes)."""
    lat = torch.randn(nb * bs, C, generator=g) * 2
    rope = torch.randn(nb * bs, R, generator=g)
    rows = pack_mla_rows(fmt, lat, rope).view(nb, bs, -1)
    rb = rows.shape[-1]
    big = torch.randint(0, 255, (nb, 2 * bs, rb + pad), generator=g, dtype=torch.uint8)
    big[:, ::2, :rb] = rows
    return big[:, ::2, :rb]


def _indices(t: int, k: int, rows: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, rows, (t, k), generator=g, dtype=torch.int32)
    idx[torch.rand(t, k, generator=g) < 0.25] = -1
    if t > 1:
        idx[t - 1] = -1  # an all-masked token: out 0, lse -inf
    return idx


def _run(
    fmt: str, t: int, h: int, k: int, dtype: torch.dtype, seed: int, *, head_major: bool = False,
    pad: int = 0, **kw,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``head_major``: q as the model's einsum returns it (a ``[H, T, C]`` buffer's view)."""
    g = torch.Generator().manual_seed(seed)
    nb, bs = 5, 8
    kv = _pool(fmt, nb, bs, g, pad)
    idx = _indices(t, k, nb * bs, g)
    ql = torch.randn(t, h, C, generator=g).to(dtype)
    qr = torch.randn(t, h, R, generator=g).to(dtype)
    if head_major:
        ql, qr = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (ql, qr))
    ref_o, ref_l = sparse_mla_decode_reference(ql, qr, kv, idx, SCALE, fmt)
    out, lse = smt.sparse_mla_decode_triton(ql, qr, kv, idx, SCALE, fmt, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref_o.float(), **tol)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)
    if t > 1:
        assert torch.equal(out[t - 1], torch.zeros_like(out[t - 1]))
        assert torch.isneginf(lse[t - 1]).all()
    return out, lse


def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN-filled floats: an element no kernel writes fails a check."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(fmt: str, dtype: torch.dtype, splits: int) -> None:
    seed = 10 * (fmt == "bf16") + 5 * (dtype == torch.bfloat16) + splits + 20
    cfg = smt.DecodeConfig(4, 8)
    _run(fmt, 3, 4, 32, dtype, seed, num_splits=splits, config=cfg)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_decode_rows_not_16_byte_aligned(fmt: str) -> None:
    """Row strides off the 16-byte grid (4 bytes of padding) take the unhinted loads."""
    cfg = smt.DecodeConfig(4, 8)
    _run(fmt, 3, 4, 32, torch.float32, 90 + (fmt == "bf16"), pad=4, num_splits=2, config=cfg)


def test_wide_kernel_head_block_wider_than_heads() -> None:
    """Heads padded inside a block (5 of 8) and a top-k not a multiple of the row tile."""
    cfg = smt.DecodeConfig(8, 16)
    _run("fp8_ds_mla", 2, 5, 37, torch.float32, 71, num_splits=2, config=cfg)


@pytest.mark.parametrize("seed", range(4))
def test_decode_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(500 + seed)
    t = int(torch.randint(1, 4, (1,), generator=g))
    h = int(torch.randint(1, 5, (1,), generator=g))
    k = int(torch.randint(1, 33, (1,), generator=g))
    fmt = ["fp8_ds_mla", "bf16"][seed % 2]
    # Default tile shape (heads and indices padded and masked inside the kernel).
    _run(fmt, t, h, k, torch.float32, seed)


def test_more_splits_than_tiles_gives_empty_splits() -> None:
    """A split past the last index contributes nothing (lse -inf), not NaN."""
    _run("fp8_ds_mla", 2, 3, 9, torch.float32, 77, num_splits=4, config=smt.DecodeConfig(4, 8))


def test_poisoned_outputs_are_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element of out / lse is written, also through the combine step (NaN-filled
    allocations: an unwritten element would fail the comparison)."""
    _poison_empty(monkeypatch)
    for splits in (1, 2):
        _run("bf16", 3, 4, 16, torch.float32, 90 + splits, num_splits=splits)
    cfg = smt.DecodeConfig(4, 8)
    _run("fp8_ds_mla", 3, 4, 16, torch.float32, 95, num_splits=2, config=cfg)


@pytest.mark.parametrize("splits", [1, 3])
def test_tokens_past_the_grid_limit_run_in_slices(
    splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More tokens than grid axis 1 takes (CUDA: 65535; lowered to 2 here) run as launches
    over token slices, partials and combine included: every element written (NaN-poisoned
    allocations), bit-equal to one launch over all tokens, and the reference's (in `_run`);
    q head-major there, as the model's einsum gives it (slices of a strided view)."""
    cfg = smt.DecodeConfig(4, 8)
    args = ("fp8_ds_mla", 5, 3, 24, torch.float32, 130 + splits)
    whole = _run(*args, num_splits=splits, config=cfg)
    launches: list[list[tuple[int, int]]] = []
    real = triton_split.grid_slices
    monkeypatch.setattr(triton_split, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(smt, "grid_slices", lambda n: launches.append(real(n)) or launches[-1])
    _poison_empty(monkeypatch)
    out, lse = _run(*args, num_splits=splits, config=cfg, head_major=True)
    assert launches == [[(0, 2), (2, 4), (4, 5)]]
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])


def test_split_heuristic() -> None:
    """One split once the batch fills the SMs (no partials), many at batch 1."""
    cfg = smt.DecodeConfig()
    cpu = torch.device("cpu")  # 4 SMs assumed off-GPU
    assert smt.num_splits_for(64, 128, 2048, cfg, cpu) == 1
    assert smt.num_splits_for(1, 128, 2048, cfg, cpu) > 1


def test_dispatch_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(smt, "sparse_mla_decode_triton", lambda *a, **k: calls.append(1))
    g = torch.Generator().manual_seed(3)
    kv = _pool("bf16", 2, 8, g)
    ql, qr = torch.randn(1, 2, C, generator=g), torch.randn(1, 2, R, generator=g)
    idx = torch.arange(8, dtype=torch.int32)[None]
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    out, _ = sparse_mla_decode(ql, qr, kv, idx, SCALE, "bf16")
    assert not calls and out.shape == (1, 2, C)
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    sparse_mla_decode(ql, qr, kv, idx, SCALE, "bf16")
    assert calls == [1]
    # The fp32 test format is not a kernel format: it falls back even when forced.
    kv32 = pack_mla_rows("fp32", torch.randn(16, C), torch.randn(16, R)).view(2, 8, -1)
    sparse_mla_decode(ql, qr, kv32, idx, SCALE, "fp32")
    assert calls == [1]
    monkeypatch.setenv("HISPARSE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="HISPARSE_ATTENTION"):
        sparse_mla_decode(ql, qr, kv, idx, SCALE, "bf16")


def test_rejects_unsupported_inputs() -> None:
    kv = torch.zeros(2, 8, 2 * (256 + R), dtype=torch.uint8)
    with pytest.raises(ValueError, match="Triton sparse MLA"):
        smt.sparse_mla_decode_triton(
            torch.zeros(1, 1, 256), torch.zeros(1, 1, R), kv,
            torch.zeros(1, 4, dtype=torch.int32), SCALE, "bf16",
        )  # fmt: skip
