"""Reference sparse MLA and lightning-indexer ops against straightforward dense math."""

import math

import pytest
import torch

from hisparse.attention import (
    hadamard_transform,
    indexer_scores_exact,
    indexer_scores_fp8,
    indexer_topk,
    quantize_indexer_fp8,
    sparse_mla_decode_reference,
)
from hisparse.kv.row_formats import mla_row_bytes, pack_mla_rows, unpack_mla_rows


def _paged(fmt, latent, rope, block_size):
    rows = pack_mla_rows(fmt, latent, rope)
    nb = -(-rows.shape[0] // block_size)
    cache = torch.zeros(nb * block_size, rows.shape[-1], dtype=torch.uint8)
    cache[: rows.shape[0]] = rows
    return cache.view(nb, block_size, -1)


def _dense_attention(q_lat, q_rope, latent, rope, idx, scale):
    """Per token: softmax over its selected rows (duplicates count twice), written naively."""
    t, h, c = q_lat.shape
    out = torch.zeros(t, h, c, dtype=torch.float64)
    lse = torch.full((t, h), -math.inf, dtype=torch.float64)
    for i in range(t):
        sel = [j for j in idx[i].tolist() if j >= 0]
        if not sel:
            continue
        keys = torch.cat([latent[sel], rope[sel]], dim=-1).double()
        q = torch.cat([q_lat[i], q_rope[i]], dim=-1).double()
        s = q @ keys.t() * scale
        lse[i] = torch.logsumexp(s, dim=-1)
        out[i] = torch.softmax(s, dim=-1) @ latent[sel].double()
    return out, lse


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_ds_mla"])
def test_sparse_mla_matches_dense_attention_over_decoded_rows(fmt):
    g = torch.Generator().manual_seed(0)
    n_rows, bs, t, h, k = 40, 8, 5, 4, 12
    latent, rope = torch.randn(n_rows, 512, generator=g), torch.randn(n_rows, 64, generator=g)
    cache = _paged(fmt, latent, rope, bs)
    q_lat, q_rope = torch.randn(t, h, 512, generator=g), torch.randn(t, h, 64, generator=g)
    idx = torch.randint(0, n_rows, (t, k), generator=g, dtype=torch.int32)
    idx[1, 3:] = -1  # partly masked
    idx[2, :] = -1  # nothing to attend to
    idx[3, 1] = idx[3, 0]  # a duplicate counts twice, as in the kernel
    scale = 192**-0.5
    out, lse = sparse_mla_decode_reference(q_lat, q_rope, cache, idx, scale, fmt)
    # The oracle attends over the rows as stored (decoded), so the only difference is fp32
    # versus fp64 summation: relative 1e-5 is ample for K = 12.
    dec_lat, dec_rope = unpack_mla_rows(fmt, cache.view(-1, mla_row_bytes(fmt)))
    ref_out, ref_lse = _dense_attention(q_lat, q_rope, dec_lat, dec_rope, idx, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros(h, 512)) and torch.isneginf(lse[2]).all()


def test_sparse_mla_quantized_rows_stay_close_to_fp32_rows():
    """Attention output error from the row format alone, at DeepSeek dimensions.

    Bounds: bf16 rows carry relative error 2^-8 per value, e4m3 latents 2^-4 (plus a tiny
    subnormal term); the output is a convex combination of value rows, so its error is about
    the per-value error times the row magnitude, and the softmax weights move by the key
    error times |q| * scale. Measured: bf16 1.5e-3, fp8 2.4e-2 of max |out|; bounds ~5x that.
    """
    g = torch.Generator().manual_seed(1)
    n_rows, t, h, k = 256, 4, 16, 64
    latent, rope = torch.randn(n_rows, 512, generator=g), torch.randn(n_rows, 64, generator=g)
    q_lat = torch.randn(t, h, 512, generator=g) * 0.05
    q_rope = torch.randn(t, h, 64, generator=g) * 0.05
    idx = torch.randperm(n_rows, generator=g)[: t * k].view(t, k).int()
    outs = {
        fmt: sparse_mla_decode_reference(
            q_lat, q_rope, _paged(fmt, latent, rope, 16), idx, 192**-0.5, fmt
        )[0]
        for fmt in ("fp32", "bf16", "fp8_ds_mla")
    }
    peak = outs["fp32"].abs().max()
    assert (outs["bf16"] - outs["fp32"]).abs().max() <= 1e-2 * peak
    assert (outs["fp8_ds_mla"] - outs["fp32"]).abs().max() <= 1.25e-1 * peak


def test_sparse_mla_chunks_long_inputs_identically():
    """The reference splits long inputs into token chunks; results must not depend on it."""
    import hisparse.attention.sparse_mla_reference as mod

    g = torch.Generator().manual_seed(2)
    latent, rope = torch.randn(64, 128, generator=g), torch.randn(64, 16, generator=g)
    cache = _paged("fp32", latent, rope, 16)
    q_lat, q_rope = torch.randn(9, 2, 128, generator=g), torch.randn(9, 2, 16, generator=g)
    idx = torch.randint(-1, 64, (9, 7), generator=g, dtype=torch.int32)
    whole = sparse_mla_decode_reference(q_lat, q_rope, cache, idx, 0.1, "fp32")
    saved = mod._CHUNK_ELEMENTS
    try:
        mod._CHUNK_ELEMENTS = 1
        pieces = sparse_mla_decode_reference(q_lat, q_rope, cache, idx, 0.1, "fp32")
    finally:
        mod._CHUNK_ELEMENTS = saved
    assert torch.equal(whole[0], pieces[0]) and torch.equal(whole[1], pieces[1])


def test_hadamard_is_sylvester_and_orthonormal():
    n = 8
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, n)
    torch.testing.assert_close(hadamard_transform(x), x @ h.t() / math.sqrt(n))
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_transform(torch.randn(2, 6))


def test_indexer_scores_formula():
    g = torch.Generator().manual_seed(3)
    q, w, k = (
        torch.randn(3, 4, 32, generator=g),
        torch.randn(3, 4, generator=g),
        torch.randn(10, 32, generator=g),
    )
    s = indexer_scores_exact(q, w, k, 32**-0.5)
    naive = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q, k) / 32**0.5))
    torch.testing.assert_close(s, naive)


@pytest.mark.parametrize("dim", [128, 256])
def test_fp8_indexer_scores_track_exact_scores(dim):
    """Hadamard + e4m3 with power-of-two scales: per-score error ~2^-4 of the score scale."""
    g = torch.Generator().manual_seed(4)
    q, w, k = (
        torch.randn(6, 8, dim, generator=g),
        torch.rand(6, 8, generator=g),
        torch.randn(50, dim, generator=g),
    )
    exact = indexer_scores_exact(q, w, k, dim**-0.5)
    q8, qs = quantize_indexer_fp8(hadamard_transform(q))
    k8, ks = quantize_indexer_fp8(hadamard_transform(k))
    approx = indexer_scores_fp8(q8, qs, w, k8, ks, dim**-0.5)
    assert (approx - exact).abs().max() <= 0.1 * exact.abs().max()
    # The top few keys of each query survive quantization (the selection is what matters).
    top_exact = exact.topk(5).indices
    top_fp8 = approx.topk(10).indices
    hits = sum(
        len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_exact, top_fp8, strict=True)
    )
    assert hits >= 0.9 * top_exact.numel()


def test_topk_is_causal_and_padded():
    scores = torch.tensor([[5.0, 1.0, 9.0, 3.0], [5.0, 1.0, 9.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    out = indexer_topk(scores, torch.tensor([1, 3, 4]), 2)
    assert out.dtype == torch.int32
    assert out[0].tolist() == [0, -1]  # one valid key: it and padding
    assert sorted(out[1].tolist()) == [0, 2]  # key 3 is in the future
    assert sorted(out[2].tolist()) == [2, 3]
    wide = indexer_topk(scores, torch.tensor([1, 3, 4]), 6)
    assert sorted(x for x in wide[1].tolist() if x >= 0) == [0, 1, 2]
    assert wide[1].tolist().count(-1) == 3
