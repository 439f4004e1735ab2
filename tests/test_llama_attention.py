"""GQA row format, reference sparse GQA attention and the training-free GQA indexer (ops level)."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.gqa_indexer_keys import read_index_keys, rope_pair_dims, write_index_keys
from hisparse.attention.gqa_indexer_reference import (
    GqaIndexerConfig,
    GqaIndexerFormat,
    gqa_indexer_topk,
    gqa_indexer_topk_prefill,
    pad_groups,
)
from hisparse.attention.gqa_indexer_select import dense_topk
from hisparse.attention.sparse_gqa_reference import (
    GqaRowFormat,
    causal_gqa_reference,
    selected_gqa_reference,
    selected_gqa_varlen_reference,
    sparse_gqa_reference,
)

G, H, D = 3, 9, 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("dtype", "nbytes"), [("bf16", 768), ("fp32", 1536), ("fp16", 768)])
def test_row_format_round_trip(dtype, nbytes):
    fmt = GqaRowFormat(G, D, dtype)
    assert fmt.row_bytes == nbytes and fmt.row_bytes % 16 == 0
    k, v = torch.randn(2, 5, G, D, generator=_gen(0)).unbind(0)
    rows = fmt.pack(k, v)
    assert rows.dtype == torch.uint8 and rows.shape == (5, nbytes)
    k2, v2 = fmt.unpack(rows)
    assert torch.equal(k2, k.to(fmt.torch_dtype)) and torch.equal(v2, v.to(fmt.torch_dtype))
    with pytest.raises(ValueError, match="GQA rows must be uint8"):
        fmt.unpack(rows[:, :-16])
    with pytest.raises(ValueError, match="bf8"):
        GqaRowFormat(G, D, "bf8")


def _paged(fmt: GqaRowFormat, k, v, block_size: int, seed: int):
    """Rows of positions 0..S-1 scattered over a shuffled block table."""
    s = k.shape[0]
    nb = -(-s // block_size)
    blocks = torch.randperm(nb + 3, generator=_gen(seed))[:nb] + 1
    cache = torch.zeros(nb + 4, block_size, fmt.row_bytes, dtype=torch.uint8)
    pos = torch.arange(s)
    phys = blocks[pos // block_size] * block_size + pos % block_size
    cache[phys // block_size, phys % block_size] = fmt.pack(k, v)
    return cache, phys


def _dense_attention(q, k, v, allowed, scale):
    """Plain masked softmax attention, K/V heads repeated for their query heads."""
    kk = k.repeat_interleave(H // G, dim=1)  # [S, H, D]
    vv = v.repeat_interleave(H // G, dim=1)
    scores = torch.einsum("thd,shd->ths", q, kk) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("ths,shd->thd", scores.softmax(-1), vv)


def test_sparse_equals_dense_attention_on_the_selected_rows():
    s, t = 40, 6
    fmt = GqaRowFormat(G, D, "fp32")
    q = torch.randn(t, H, D, generator=_gen(1))
    k, v = torch.randn(2, s, G, D, generator=_gen(2)).unbind(0)
    cache, phys = _paged(fmt, k, v, 8, seed=3)
    # Causal rows for queries at positions 34..39, then a sparse subset with -1 padding.
    positions = torch.arange(s - t, s)
    causal = torch.arange(s)[None, :] <= positions[:, None]
    idx = torch.where(causal, phys[None, :].expand(t, -1), torch.full((t, s), -1))
    out, lse = sparse_gqa_reference(q, cache, idx, D**-0.5, fmt)
    torch.testing.assert_close(out, _dense_attention(q, k, v, causal, D**-0.5))
    assert lse.shape == (t, H) and torch.isfinite(lse).all()

    pick = torch.tensor([0, 3, 17, 33])
    sub = torch.full((t, 6), -1)
    sub[:, :4] = phys[pick]
    allowed = torch.zeros(t, s, dtype=torch.bool)
    allowed[:, pick] = True
    out, _ = sparse_gqa_reference(q, cache, sub, D**-0.5, fmt)
    torch.testing.assert_close(out, _dense_attention(q, k, v, allowed, D**-0.5))

    # The one-gather dense path gives the same attention.
    dense = causal_gqa_reference(q, cache, phys, positions, D**-0.5, fmt)
    torch.testing.assert_close(dense, _dense_attention(q, k, v, causal, D**-0.5))

    none = torch.full((1, 4), -1)
    out, lse = sparse_gqa_reference(q[:1], cache, none, D**-0.5, fmt)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("method", ["fp8", "quest", "lowrank"])
def test_index_format_budget(method):
    """At most a quarter of a bf16 KV row per token (SmolLM2 shapes)."""
    fmt = GqaIndexerFormat(method, G, D, quest_chunk=16, lowrank_pairs=8)
    assert fmt.row_bytes <= GqaRowFormat(G, D, "bf16").row_bytes // 4
    assert fmt.page_bytes(16) == 16 * fmt.row_bytes
    if method == "quest":
        with pytest.raises(ValueError, match="not a multiple of quest_chunk"):
            fmt.page_bytes(8)


def _pages(fmt: GqaIndexerFormat, block_size: int, nb: int) -> torch.Tensor:
    return torch.zeros(nb, fmt.page_bytes(block_size), dtype=torch.uint8)


def test_quest_bounds_over_steps_and_block_reuse():
    fmt = GqaIndexerFormat("quest", G, D, quest_chunk=4)
    bs = 8
    pages = _pages(fmt, bs, 3)
    table = torch.tensor([2, 1], dtype=torch.int32)  # positions 0..7 in block 2, 8..15 in 1
    k = torch.randn(13, G, D, generator=_gen(4))
    pos = torch.arange(13)
    slots = table[pos // bs].long() * bs + pos % bs
    for lo, hi in ((0, 6), (6, 7), (7, 13)):  # a prefill chunk, one token, the rest
        write_index_keys(pages, fmt, slots[lo:hi], k[lo:hi])
    bounds = read_index_keys(pages, fmt, table, 13)
    assert bounds.shape == (4, 2, G, D)
    for c in range(4):
        part = k[4 * c : min(13, 4 * c + 4)]
        assert torch.equal(bounds[c, 0], part.amin(0)) and torch.equal(bounds[c, 1], part.amax(0))
    # The block is reused by another request: its first token restarts the chunk.
    fresh = torch.randn(1, G, D, generator=_gen(5))
    write_index_keys(pages, fmt, torch.tensor([2 * bs]), fresh)
    again = read_index_keys(pages, fmt, table, 1)
    assert torch.equal(again[0, 0], fresh[0]) and torch.equal(again[0, 1], fresh[0])


def test_fp8_and_lowrank_keys_read_back_in_position_order():
    k = torch.randn(10, G, D, generator=_gen(6)) * 5
    table = torch.tensor([3, 1, 2], dtype=torch.int32)
    pos = torch.arange(10)
    slots = table[pos // 4].long() * 4 + pos % 4
    fp8 = GqaIndexerFormat("fp8", G, D)
    pages = _pages(fp8, 4, 4)
    write_index_keys(pages, fp8, slots, k)
    back = read_index_keys(pages, fp8, table, 10)
    torch.testing.assert_close(back, k, rtol=0.07, atol=0.01)  # e4m3: 3 mantissa bits
    low = GqaIndexerFormat("lowrank", G, D, lowrank_pairs=4)
    dims = torch.tensor([[0, 5, 9, 20, 32, 37, 41, 52]] * G)
    pages = _pages(low, 4, 4)
    write_index_keys(pages, low, slots, k, dims)
    back = read_index_keys(pages, low, table, 10)
    torch.testing.assert_close(back, k[:, :, dims[0]], rtol=1e-3, atol=1e-3)


def test_rope_pair_dims_keep_whole_pairs():
    wq = torch.randn(H * D, 32, generator=_gen(7))
    wk = torch.randn(G * D, 32, generator=_gen(8))
    wk.view(G, D, 32)[1, [3, 3 + D // 2]] *= 50  # one dominant pair in KV head 1
    dims = rope_pair_dims(wq, wk, H, G, pairs=5)
    assert dims.shape == (G, 10)
    assert torch.equal(dims[:, 5:], dims[:, :5] + D // 2)
    assert 3 in dims[1].tolist()


@pytest.mark.parametrize("method", ["fp8", "quest", "lowrank"])
def test_topk_keeps_sinks_window_and_budget(method):
    cfg = GqaIndexerConfig(top_k=24, method=method, sink_tokens=2, recent_window=16)
    fmt = GqaIndexerFormat.for_config(cfg, G, D)
    s, bs = 70, 16
    k = torch.randn(s, G, D, generator=_gen(9))
    table = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
    pos = torch.arange(s)
    pages = _pages(fmt, bs, 6)
    dims = torch.arange(2 * cfg.lowrank_pairs).expand(G, -1) if method == "lowrank" else None
    write_index_keys(pages, fmt, table[pos // bs].long() * bs + pos % bs, k, dims)
    q = torch.randn(s, H, D, generator=_gen(10))
    topk = gqa_indexer_topk(q, pos, pages, table, s, fmt, cfg, D**-0.5, 24, dims)
    assert topk.dtype == torch.int32 and topk.shape == (s, 24)
    for t in (0, 10, 23, 24, 50, 69):
        row = topk[t][topk[t] >= 0].tolist()
        assert row == sorted(row) and len(row) == min(t + 1, 24) and max(row) == t
        assert set(range(min(2, t + 1))) | set(range(max(0, t - 15), t + 1)) <= set(row)
    # Budget at least the length: every earlier position, ascending (dense).
    dense = gqa_indexer_topk(q, pos, pages, table, s, fmt, GqaIndexerConfig(top_k=70), 1.0, 70)
    assert torch.equal(dense, dense_topk(pos, 70))


def test_fp8_topk_follows_the_attention_mass():
    """A key that dominates one query head's attention is chosen even if others ignore it."""
    cfg = GqaIndexerConfig(top_k=8, sink_tokens=0, recent_window=1)
    fmt = GqaIndexerFormat.for_config(cfg, G, D)
    s = 40
    k = torch.randn(s, G, D, generator=_gen(11)) * 0.1
    q = torch.randn(1, H, D, generator=_gen(12)) * 0.1
    k[17, 2] = q[0, 7] * 200  # head 7 reads KV head 2
    table = torch.arange(1, 4, dtype=torch.int32)
    pages = _pages(fmt, 16, 4)
    pos = torch.arange(s)
    write_index_keys(pages, fmt, table[pos // 16].long() * 16 + pos % 16, k)
    topk = gqa_indexer_topk(q, torch.tensor([39]), pages, table, s, fmt, cfg, D**-0.5, 8)
    assert 17 in topk[0].tolist() and 39 in topk[0].tolist()


def test_indexer_config_validation():
    with pytest.raises(ValueError, match="indexer method"):
        GqaIndexerConfig(method="magic")
    with pytest.raises(ValueError, match="smaller than sink_tokens"):
        GqaIndexerConfig(top_k=16, sink_tokens=4, recent_window=64)
    with pytest.raises(ValueError, match="quest needs recent_window"):
        GqaIndexerConfig(top_k=64, method="quest", recent_window=8, quest_chunk=16)


def test_pad_groups_lists_members_in_order():
    group = torch.tensor([1, -1, 0, 1, 1, 0, -1])
    want = torch.tensor([[2, 5, -1], [0, 3, 4], [-1, -1, -1]])
    assert torch.equal(pad_groups(group, 3), want)
    assert pad_groups(torch.full((3,), -1), 2).shape == (2, 0)


def test_varlen_selected_attention_equals_per_request():
    """Several requests in one padded pass = `selected_gqa_reference` of each (padding rows
    hold NaN garbage that must not leak)."""
    fmt = GqaRowFormat(G, D, "fp32")
    lens, tokens = [30, 12, 21], [5, 1, 7]
    rows_l, sel_l, q_l = [], [], []
    u_max, t_max = max(lens), max(tokens)
    bs = 8
    nb = sum(-(-n // bs) for n in lens) + 2
    cache = torch.full((nb, bs, fmt.row_bytes), 255, dtype=torch.uint8)  # NaN garbage
    free = iter(torch.randperm(nb - 1, generator=_gen(20)).tolist())
    for r, (n, t) in enumerate(zip(lens, tokens, strict=True)):
        k, v = torch.randn(2, n, G, D, generator=_gen(21 + r)).unbind(0)
        blocks = torch.tensor([next(free) + 1 for _ in range(-(-n // bs))])
        pos = torch.arange(n)
        phys = blocks[pos // bs] * bs + pos % bs
        cache[phys // bs, phys % bs] = fmt.pack(k, v)
        rows_l.append(phys)
        sel_l.append(torch.rand(t, n, generator=_gen(31 + r)) < 0.5)
        q_l.append(torch.randn(t, H, D, generator=_gen(41 + r)))
    sel_l[1][0] = False  # a token that selects nothing gets 0
    rows = torch.full((len(lens), u_max), -1)
    selected = torch.zeros(len(lens), t_max, u_max, dtype=torch.bool)
    q = torch.full((len(lens), t_max, H, D), float("nan"))
    for r, (n, t) in enumerate(zip(lens, tokens, strict=True)):
        rows[r, :n], selected[r, :t, :n], q[r, :t] = rows_l[r], sel_l[r], q_l[r]
    out = selected_gqa_varlen_reference(q, cache, rows, selected, D**-0.5, fmt)
    for r, t in enumerate(tokens):
        want = selected_gqa_reference(q_l[r], cache, rows_l[r], sel_l[r], D**-0.5, fmt)
        torch.testing.assert_close(out[r, :t], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 0], torch.zeros(H, D))


@pytest.mark.parametrize("method", ["fp8", "quest", "lowrank"])
def test_batched_prefill_topk_equals_per_request(method):
    """One batched scoring of a packed step chooses what `gqa_indexer_topk` chooses request
    by request (a dense request, a long prefill chunk, a single decode row, padding)."""
    cfg = GqaIndexerConfig(top_k=24, method=method, sink_tokens=2, recent_window=16)
    fmt = GqaIndexerFormat.for_config(cfg, G, D)
    bs, width = 16, 24
    lens, counts = [70, 20, 45], [50, 20, 1]
    pages = _pages(fmt, bs, 16)
    dims = torch.arange(2 * cfg.lowrank_pairs).expand(G, -1) if method == "lowrank" else None
    tables = torch.zeros(3, 5, dtype=torch.int32)
    free = iter(torch.randperm(15, generator=_gen(50)).tolist())
    qs, positions, req = [], [], []
    for r, (n, c) in enumerate(zip(lens, counts, strict=True)):
        tables[r, : -(-n // bs)] = torch.tensor([next(free) + 1 for _ in range(-(-n // bs))])
        pos = torch.arange(n)
        k = torch.randn(n, G, D, generator=_gen(51 + r))
        write_index_keys(pages, fmt, tables[r][pos // bs].long() * bs + pos % bs, k, dims)
        qs.append(torch.randn(c, H, D, generator=_gen(61 + r)))
        positions.append(torch.arange(n - c, n))
        req.append(torch.full((c,), r))
    # requests interleaved with a padding token, as a packed step may be
    q = torch.cat([*qs, torch.randn(1, H, D)])
    pos = torch.cat([*positions, torch.tensor([0])])
    rix = torch.cat([*req, torch.tensor([-1])])
    perm = torch.randperm(q.shape[0], generator=_gen(70))
    got = gqa_indexer_topk_prefill(
        q[perm], pos[perm], rix[perm], pages, tables, lens, fmt, cfg, D**-0.5, width, dims
    )
    inv = torch.argsort(perm)
    got = got[inv]
    lo = 0
    for r, c in enumerate(counts):
        want = gqa_indexer_topk(
            qs[r], positions[r], pages, tables[r], lens[r], fmt, cfg, D**-0.5, width, dims
        )
        assert torch.equal(got[lo : lo + c], want), r
        lo += c
    assert (got[-1] == -1).all()


# ---------------------------------------------------------------------------------------------
# CPU decode fast paths: each against the general path it replaces
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strided", [False, True])
def test_sdpa_decode_cpu_matches_reference(strided: bool) -> None:
    """The fused CPU decode attention gives the reference's output (dense cache and a pool
    whose blocks are strided); a masked entry makes it decline (the reference then runs)."""
    from hisparse.attention.dispatch import sparse_gqa_decode
    from hisparse.attention.sparse_gqa_reference import _sdpa_decode_cpu

    g = _gen(21)
    fmt = GqaRowFormat(G, D, "fp32")
    nb, bs = 12, 16
    pool = torch.randn(nb, bs, (2 if strided else 1) * fmt.row_bytes // 4, generator=g)
    cache = pool.view(torch.uint8)[:, :, : fmt.row_bytes]
    q = torch.randn(2, H, D, generator=g)
    idx = torch.stack([torch.randperm(nb * bs, generator=g)[:40] for _ in range(2)]).int()
    want, _ = sparse_gqa_reference(q, cache, idx, D**-0.5, fmt)
    got, lse = sparse_gqa_decode(q, cache, idx, D**-0.5, fmt, need_lse=False)
    assert lse is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    idx[1, 3] = -1
    assert _sdpa_decode_cpu(q, cache, idx, D**-0.5, fmt) is None
    masked, _ = sparse_gqa_decode(q, cache, idx, D**-0.5, fmt, need_lse=False)
    assert torch.equal(masked, sparse_gqa_reference(q, cache, idx, D**-0.5, fmt)[0])


def test_rope_full_width_is_bitwise_rope_half_split() -> None:
    from hisparse.models.layers import full_width_rope, rope_full_width, rope_half_split
    from hisparse.models.llama import LlamaConfig, Rotary

    cfg = LlamaConfig(64, 32, 64, 1, H, G, D)
    cos, sin = Rotary(cfg)(torch.tensor([0, 5, 700, 4095]), torch.float32)
    x = torch.randn(4, H, D, generator=_gen(22)) * 10
    assert torch.equal(rope_full_width(x, *full_width_rope(cos, sin)), rope_half_split(x, cos, sin))


@pytest.mark.parametrize("slots", [[37], [-1], [5, 40, 17], [5, -1, 17]])
def test_write_rows_fast_matches_write_rows_where(slots: list[int]) -> None:
    from hisparse.kv.row_formats import write_rows_fast, write_rows_where

    g = _gen(23)
    base = torch.randint(0, 256, (4, 16, 24), generator=g, dtype=torch.uint8)  # poisoned
    values = torch.randint(0, 256, (len(slots), 24), generator=g, dtype=torch.uint8)
    want, got = base.clone(), base.clone()
    write_rows_where(want, torch.tensor(slots), values)
    write_rows_fast(got, torch.tensor(slots), values)
    keep = [s for s in slots if s >= 0]
    assert torch.equal(got, want) and (not keep or not torch.equal(got, base))


def test_select_topk_with_step_masks_is_identical() -> None:
    """Masks built once per step (guards skipped when ``full``) choose the same positions."""
    from hisparse.attention.gqa_indexer_select import select_topk, selection_masks

    cfg = GqaIndexerConfig(top_k=24, sink_tokens=2, recent_window=8)
    logits = torch.randn(1, H, 70, generator=_gen(24)) * 4
    for pos in ([69], [30]):
        positions = torch.tensor(pos)
        masks = selection_masks(positions, 70, H, cfg, check=True)
        assert masks.full
        want = select_topk(logits, positions, 70, cfg, 24)
        assert torch.equal(select_topk(logits, positions, 70, cfg, 24, masks), want)
    early = torch.tensor([10])  # fewer causal positions than top_k: guards stay on
    masks = selection_masks(early, 70, H, cfg, check=True)
    assert not masks.full
    want = select_topk(logits, early, 70, cfg, 24)
    assert torch.equal(select_topk(logits, early, 70, cfg, 24, masks), want)
    assert (want < 0).any()
