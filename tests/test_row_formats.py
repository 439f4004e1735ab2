"""Byte layouts of MLA rows and indexer key pages (docs/design.md §3), and round trips."""

import struct

import pytest
import torch

from hisparse.kv.row_formats import (
    FP32_MLA,
    IndexerCacheFormat,
    mla_dims_from_row_bytes,
    mla_row_bytes,
    pack_mla_rows,
    quantize_fp8_tiles,
    read_indexer_keys,
    unpack_mla_rows,
    write_indexer_keys,
)
from hisparse.kv.specs import BF16_MLA_ROW_BYTES, FP8_DS_MLA_ROW_BYTES, RowFormat


def test_row_sizes_agree_with_specs():
    assert mla_row_bytes("fp8_ds_mla") == FP8_DS_MLA_ROW_BYTES == 656
    assert mla_row_bytes(RowFormat.BF16_MLA) == BF16_MLA_ROW_BYTES == 1152
    assert mla_row_bytes(FP32_MLA) == 2304
    for fmt in ("fp8_ds_mla", "bf16", "fp32"):
        assert mla_row_bytes(fmt) % 16 == 0
        assert mla_dims_from_row_bytes(fmt, mla_row_bytes(fmt)) == 512
    assert mla_row_bytes("fp8_ds_mla", 128, 16) == 128 + 4 + 32
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_row_bytes("fp8_ds_mla", 96, 16)
    with pytest.raises(ValueError, match="not an MLA row format"):
        mla_row_bytes("indexer_fp8")


def test_fp8_ds_mla_exact_bytes():
    latent = torch.zeros(512)
    latent[0], latent[1], latent[2], latent[3] = 448.0, 1.0, -2.0, 0.5  # tile 0: amax 448
    latent[128] = 224.0  # tile 1: amax 224 -> scale 0.5 -> stored as 448
    latent[129] = -0.5  # -> -1.0
    # tile 2 all zero -> scale 0, bytes 0; tile 3: amax 3.5 -> scale 1/128
    latent[384] = 3.5
    rope = torch.zeros(64)
    rope[0], rope[63] = 1.0, -2.0
    row = pack_mla_rows("fp8_ds_mla", latent, rope)
    assert row.dtype == torch.uint8 and row.shape == (656,)
    b = bytes(row.tolist())
    # e4m3 encodings: 448 = 0x7e, 1.0 = 0x38, -2.0 = 0xc0, 0.5 = 0x30, -1.0 = 0xb8
    assert b[0:4] == bytes([0x7E, 0x38, 0xC0, 0x30])
    assert b[4:128] == bytes(124)
    assert b[128:130] == bytes([0x7E, 0xB8])
    assert b[256:384] == bytes(128)
    assert b[384] == 0x7E  # 3.5 / (3.5 / 448) = 448
    scales = struct.unpack("<4f", b[512:528])
    assert scales == (1.0, 0.5, 0.0, pytest.approx(3.5 / 448, rel=1e-7))
    assert (
        struct.unpack("<4f", b[512:528])[3] == torch.tensor(3.5 / 448, dtype=torch.float32).item()
    )
    # RoPE: bf16 little-endian, 1.0 = 0x3f80, -2.0 = 0xc000
    assert b[528:530] == bytes([0x80, 0x3F])
    assert b[654:656] == bytes([0x00, 0xC0])
    assert b[530:654] == bytes(124)
    lat2, rope2 = unpack_mla_rows("fp8_ds_mla", row)
    assert torch.equal(lat2, latent) and torch.equal(rope2, rope)


def test_bf16_and_fp32_exact_bytes():
    latent = torch.zeros(512)
    latent[0], latent[511] = 1.0, -2.0
    rope = torch.zeros(64)
    rope[0] = 0.5
    b = bytes(pack_mla_rows("bf16", latent, rope).tolist())
    assert len(b) == 1152
    assert b[0:2] == bytes([0x80, 0x3F]) and b[1022:1024] == bytes([0x00, 0xC0])
    assert b[1024:1026] == bytes([0x00, 0x3F])  # 0.5 = 0x3f00
    f = bytes(pack_mla_rows("fp32", latent, rope).tolist())
    assert len(f) == 2304
    assert struct.unpack("<f", f[0:4])[0] == 1.0 and struct.unpack("<f", f[2048:2052])[0] == 0.5


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16", "fp32"])
def test_round_trip_error_bounds(fmt):
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(3, 7, 512, generator=g) * torch.logspace(-3, 2, 7)[None, :, None]
    rope = torch.randn(3, 7, 64, generator=g)
    rows = pack_mla_rows(fmt, latent, rope)
    assert rows.shape == (3, 7, mla_row_bytes(fmt))
    lat2, rope2 = unpack_mla_rows(fmt, rows)
    if fmt == "fp32":
        assert torch.equal(lat2, latent) and torch.equal(rope2, rope)
        return
    # bf16: 8 significant bits -> relative error <= 2^-8 (round to nearest)
    assert ((rope2 - rope).abs() <= rope.abs() * 2**-8).all()
    if fmt == "bf16":
        assert ((lat2 - latent).abs() <= latent.abs() * 2**-8).all()
        return
    # e4m3: 4 significant bits -> relative error <= 2^-4 for normals; below the smallest
    # normal (2^-6 * scale) the spacing is 2^-9 * scale, so absolute error <= 2^-10 * scale.
    _, scale = quantize_fp8_tiles(latent)
    tile_scale = scale.repeat_interleave(128, dim=-1)
    bound = latent.abs() * 2**-4 + tile_scale * 2**-10
    assert ((lat2 - latent).abs() <= bound * (1 + 1e-6)).all()


def test_unpack_reads_strided_paged_views():
    """Rows of a token-major host pool (row stride > row bytes) decode like dense rows."""
    g = torch.Generator().manual_seed(1)
    latent, rope = torch.randn(8, 512, generator=g), torch.randn(8, 64, generator=g)
    rows = pack_mla_rows("fp8_ds_mla", latent, rope)
    pool = torch.zeros(2, 4, 2 * 656, dtype=torch.uint8)  # two layers side by side per token
    view = pool[:, :, 656:]
    view.copy_(rows.view(2, 4, 656))
    a = unpack_mla_rows("fp8_ds_mla", view[1, 2])
    b = unpack_mla_rows("fp8_ds_mla", rows[6])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_indexer_page_layout_132_bytes():
    fmt = IndexerCacheFormat.for_mode("fp8", 128)
    assert fmt.row_bytes == 132 and fmt.page_bytes(64) == 64 * 132
    bs, nb = 4, 3
    pages = torch.zeros(nb, fmt.page_bytes(bs), dtype=torch.uint8)
    keys = torch.zeros(2, 128)
    keys[0, 0], keys[1, 127] = 1.0, -0.5
    k8 = keys.to(torch.float8_e4m3fn)
    scales = torch.tensor([[2.0], [0.25]])
    write_indexer_keys(pages, fmt, torch.tensor([1 * bs + 2, -1]), k8, scales)  # 2nd skipped
    write_indexer_keys(pages, fmt, torch.tensor([2 * bs + 3]), k8[1:], scales[1:])
    p = pages[1]
    # keys of token 2 at bytes [2*128, 3*128); its scale after all 4 tokens' keys
    assert p[2 * 128].item() == 0x38 and p[: 2 * 128].sum() == 0
    assert bytes(p[4 * 128 + 4 * 2 : 4 * 128 + 4 * 3].tolist()) == struct.pack("<f", 2.0)
    assert pages[2][3 * 128 + 127].item() == 0xB0  # -0.5
    assert bytes(pages[2][4 * 128 + 12 : 4 * 128 + 16].tolist()) == struct.pack("<f", 0.25)
    assert pages[0].sum() == 0
    got, got_s = read_indexer_keys(pages, fmt, torch.tensor([1 * bs + 2, 2 * bs + 3]))
    assert torch.equal(got.float(), k8.float())
    assert got_s is not None and torch.equal(got_s, scales)


def test_indexer_fp32_pages_round_trip():
    fmt = IndexerCacheFormat.for_mode("exact", 64)
    assert fmt.row_bytes == 256
    pages = torch.zeros(3, fmt.page_bytes(2), dtype=torch.uint8)
    keys = torch.randn(3, 64)
    write_indexer_keys(pages, fmt, torch.tensor([2, 3, 5]), keys)
    got, none = read_indexer_keys(pages, fmt, torch.tensor([[5, 2]]))
    assert none is None and torch.equal(got[0], keys[[2, 0]])


def test_pow2_scales():
    x = torch.randn(5, 256) * 3
    q, s = quantize_fp8_tiles(x, 128, pow2_scale=True)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    amax = x.view(5, 2, 128).abs().amax(-1)
    assert (s >= amax / 448).all() and (s < 2 * amax / 448).all()
    assert q.float().abs().max() <= 448
