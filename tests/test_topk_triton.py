"""The Triton radix select (`topk_triton`) equals `topk_select_reference` exactly (Triton's
CPU interpreter, CI): fresh random rows of every sign, ``-inf`` tails and whole ``-inf``
rows, NaN, ``±0.0``, heavy ties, ``k`` above the row length, rows split into one or many
parts, the three limit modes, a poisoned output, and the engine's largest decode row (128K
keys, ``top_k`` 2048). Then the lightning indexer's Triton top-k with the select switched on
(``HISPARSE_TOPK=triton``) passes the reference's selection check.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import indexer_reference as ir
from hisparse.attention import indexer_triton as it
from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.attention.topk_floor import (
    GroupMaxima,
    floor_counts_reference,
    group_maxima_reference,
)
from hisparse.attention.topk_triton import BLOCK, topk_select_reference, topk_select_triton
from hisparse.testing import indexer_cases as ic

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


def _rows(t: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, s, generator=g) * 10.0 ** torch.randint(-3, 4, (t, 1), generator=g)
    x[:, torch.randperm(s, generator=g)[: s // 7]] *= -1
    if t > 1:
        x[1, s // 3 :] = float("-inf")  # a causal tail
    return x


def _poisoned(t: int, k: int) -> torch.Tensor:
    return torch.full((t, k), -7777, dtype=torch.int32)


@pytest.mark.parametrize(
    "t,s,k,parts",
    [(1, 1, 1, None), (1, 7, 4, None), (3, 300, 8, None), (4, 100, 200, None),
     (2, 5000, 64, None), (2, 5000, 64, 1), (3, 3 * BLOCK + 5, 100, 3), (5, 9000, 2048, None),
     (1, 5000, 64, 8), (2, 700, 30, 4)],  # (parts shorter than BLOCK: smaller blocks)
)  # fmt: skip
def test_random_rows_equal_the_reference(t: int, s: int, k: int, parts: int | None) -> None:
    x = _rows(t, s, seed=t * 1000 + s + k)
    got = topk_select_triton(x, k, out=_poisoned(t, k), parts=parts)
    assert torch.equal(got, topk_select_reference(x, k))
    # the set torch.topk picks, where the k-th score is not tied (random floats: not)
    kk = min(k, s)
    vals, idx = x.topk(kk, dim=1)
    for r in range(t):
        want = set(idx[r][vals[r] > float("-inf")].tolist())
        assert set(got[r][got[r] >= 0].tolist()) == want


def test_ties_go_to_the_lowest_positions() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (3, 1000), generator=g).float()
    x[1] = float("-inf")  # nothing to pick
    x[2, ::2] = -0.0  # -0.0 ties with 0.0, as the float compare has it
    for k in (1, 10, 333, 999, 1000, 1200):
        for parts in (3, 8):  # (8: parts of 256 keys, ties spread over many)
            got = topk_select_triton(x, k, out=_poisoned(3, k), parts=parts)
            assert torch.equal(got, topk_select_reference(x, k)), (k, parts)
    assert (got[1] == -1).all()


def test_nan_and_infinities() -> None:
    x = torch.tensor([[float("nan"), 1.0, -0.0, 0.0, float("inf"), -5.0, float("-inf")]])
    assert topk_select_triton(x, 3).tolist() == [[1, 2, 4]]  # -0.0 at 2 before 0.0 at 3
    assert topk_select_triton(x, 7).tolist() == [[1, 2, 3, 4, 5, -1, -1]]
    assert torch.equal(topk_select_triton(x, 7), topk_select_reference(x, 7))


def test_limits_positions_and_padding_tokens() -> None:
    """``limits`` bounds each row; ``positions`` + ``req_index`` give a token's causal limit
    ``position + 1`` and none to a padding token: the picks of the rows cut to those limits."""
    t, s, k = 4, 3000, 50
    x = _rows(t, s, seed=9)
    limits = torch.tensor([1, 3000, 17, 2500])
    want = topk_select_reference(x, k, limits)
    for parts in (2, 8):  # (8: short parts, some past a row's limit)
        assert torch.equal(topk_select_triton(x, k, _poisoned(t, k), limits, parts=parts), want)
    positions = limits - 1
    req_index = torch.tensor([0, 1, -1, 2])
    got = topk_select_triton(x, k, _poisoned(t, k), positions=positions, req_index=req_index)
    want[2] = -1
    assert torch.equal(got, want)


def test_writes_into_a_strided_output_view() -> None:
    x = _rows(3, 700, seed=4)
    out = torch.full((5, 40), -7777, dtype=torch.int32)
    topk_select_triton(x, 40, out=out[1:4])
    assert torch.equal(out[1:4], topk_select_reference(x, 40))
    assert (out[0] == -7777).all() and (out[4] == -7777).all()


def test_strided_limits_and_a_transposed_output() -> None:
    x = _rows(3, 500, seed=6)
    limits = torch.tensor([[5, 0], [70, 0], [500, 0]])[:, 0]  # stride 2
    want = topk_select_reference(x, 8, limits)
    assert torch.equal(topk_select_triton(x, 8, limits=limits), want)
    out = torch.full((8, 3), -7777, dtype=torch.int32).t()  # column stride 3
    topk_select_triton(x, 8, out=out, limits=limits)
    assert torch.equal(out, want)


def test_kept_histograms_are_zero_at_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to `KEPT_HIST_ROWS` rows the calls share one histogram buffer: each call's write
    launch zeroes its rows' histograms but the fourth and the next call's first launch the
    fourth. After each call the others are all zero (the floor's two included: 20,000 keys
    and ``k`` 256 take it, forced on for few rows); a fourth left dirty (poisoned here
    between calls) does not change the picks; calls of other data in a row (the kept buffer)
    and one of more rows (a fresh buffer) still equal the reference."""
    from hisparse.attention import topk_floor as tf
    from hisparse.attention import topk_radix as tr

    monkeypatch.setattr(tf, "FLOOR_MIN_ROWS", 1)
    g = torch.Generator().manual_seed(0)
    for t, s, k, seed in [(3, 5000, 300, 1), (1, 777, 50, 2), (tr.KEPT_HIST_ROWS + 1, 600, 9, 3),
                          (3, 20000, 256, 6), (tr.KEPT_HIST_ROWS, 900, 40, 4),
                          (2, 20000, 256, 7), (2, 5000, 300, 5)]:  # fmt: skip
        x = _rows(t, s, seed)
        kept = tr._kept_hist.get(x.device)
        if kept is not None:
            kept[:, 3] = torch.randint(1, 1000, kept[:, 3].shape, generator=g, dtype=kept.dtype)
        got = topk_select_triton(x, k, _poisoned(t, k))
        assert torch.equal(got, topk_select_reference(x, k))
        kept = tr._kept_hist[x.device]
        assert kept.shape[0] == tr.KEPT_HIST_ROWS and not kept[:, [0, 1, 2, 4, 5]].any()


def test_the_floor_counts_only_keys_at_or_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the floor (here for calls of any row count) the first pass keeps each row's keys at
    or above its floor from group maxima as the candidates, and the first histogram counts
    them (its total, read from a fresh buffer, equals a torch count): far fewer than the row's
    keys on random rows, all on a row of fewer maxima than picks, many on a row where the
    floor's bin holds a third of the keys; the picks equal the reference's with the floor and
    without, with limits, with parts of other sizes."""
    from hisparse.attention import topk_floor as tf
    from hisparse.attention import topk_triton as tt

    monkeypatch.setattr(tf, "FLOOR_MIN_ROWS", 1)
    t, s, k = 5, 20000, 256
    group = tf._floor_group(s, k)
    assert group == tf.FLOOR_GROUP
    x = _rows(t, s, seed=21)  # (row 1: -inf from s // 3 on)
    x[2] = torch.randint(0, 3, (s,)).float()  # ties at the k-th score, across parts
    x[3, 3000:] = float("-inf")  # fewer finite maxima than picks: no floor
    x[4, ::5] = float("nan")
    bufs = []

    def fresh(rows: int, device: torch.device) -> tuple[torch.Tensor, bool]:
        bufs.append(torch.zeros((rows, tt.HISTS, tt.BINS), dtype=torch.int32, device=device))
        return bufs[-1], False

    monkeypatch.setattr(tt, "_histograms", fresh)
    want = topk_select_reference(x, k)
    assert torch.equal(topk_select_triton(x, k, _poisoned(t, k)), want)
    counted = bufs[-1][:, 0].sum(dim=1)
    assert torch.equal(counted, floor_counts_reference(x, k, group))
    assert (counted[[0, 1, 4]] < s // 20).all() and (counted >= k).all()
    assert counted[3] == 3000 and counted[2] > s // 4
    assert torch.equal(topk_select_triton(x, k, _poisoned(t, k), floor=False), want)
    assert bufs[-1][:, 0].sum(dim=1)[0] == s  # (no floor: every key)
    limits = torch.tensor([s, 4000, 9000, 2000, 17])
    cut = torch.where(torch.arange(s)[None, :] < limits[:, None], x, float("-inf"))
    for parts in (1, 7, 40):
        got = topk_select_triton(x, k, _poisoned(t, k), limits, parts=parts)
        assert torch.equal(got, topk_select_reference(x, k, limits)), parts
        assert torch.equal(bufs[-1][:, 0].sum(dim=1), floor_counts_reference(cut, k, group))


@pytest.mark.parametrize(
    "t,s,k,blocks",
    [(3, 9000, 64, None), (2, 131168, 2048, None), (4, 33000, 2048, None),
     (3, 9000, 64, (128, 256)), (4, 33000, 2048, (128, 2048))],
)  # fmt: skip
def test_random_rows_with_the_floor(
    t: int, s: int, k: int, blocks: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random rows through the floor (forced on for these row counts and, at 33K keys, for
    groups of 4) equal the reference, up to the engine's largest decode row; also with the
    floor's second launch reading other maxima an iteration and the launches after the
    compaction other candidates. The first row's largest keys are its last."""
    from hisparse.attention import topk_floor as tf
    from hisparse.attention import topk_triton as tt

    monkeypatch.setattr(tf, "FLOOR_MIN_ROWS", 1)
    monkeypatch.setattr(tf, "FLOOR_MIN_GROUP", 4)
    if blocks:
        monkeypatch.setattr(tt, "FLOOR_BYTE_BLOCK", blocks[0])
        monkeypatch.setattr(tt, "FLOOR_CAND_BLOCK", blocks[1])
    assert tf._floor_group(s, k) >= 4
    x = _rows(t, s, seed=s + k)
    x[0, -k // 2 :] += 1e6
    got = topk_select_triton(x, k, out=_poisoned(t, k))
    assert torch.equal(got, topk_select_reference(x, k))


def test_group_maxima_written_or_handed_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor's group maxima: given unfilled buffers (`GroupMaxima`), the select's first
    launch writes each group's maximum up to the row's limit and the maxima's first-byte
    histogram as `group_maxima_reference` has them (a fresh histogram buffer, which the write
    launch leaves as it is); handed in filled (as the Gluon score kernel writes them) it
    skips that launch and picks the same. A group width other than the call's is refused."""
    from hisparse.attention import topk_floor as tf
    from hisparse.attention import topk_triton as tt

    monkeypatch.setattr(tf, "FLOOR_MIN_ROWS", 1)
    t, s, k = 4, 20000, 256
    group = tf._floor_group(s, k)
    x = _rows(t, s, seed=33)
    x[2] = torch.randint(0, 3, (s,)).float()
    x[3, ::5] = float("nan")
    x[0, 5:9] = -0.0
    limits = torch.tensor([s, 4000, 9001, 17])
    want = topk_select_reference(x, k, limits)
    gmax, hist = group_maxima_reference(x, group, limits)
    n_groups = (limits + group - 1) // group

    def buffers(filled: bool) -> GroupMaxima:
        g = torch.full_like(gmax, 12345)
        h = torch.zeros((t, tt.HISTS, tt.BINS), dtype=torch.int32)
        if filled:
            g.copy_(gmax)
            h[:, 4] = hist
        return GroupMaxima(group, g, h, clear=False, filled=filled)

    m = buffers(False)
    assert torch.equal(topk_select_triton(x, k, _poisoned(t, k), limits, maxima=m), want)
    for r in range(t):
        assert torch.equal(m.gmax[r, : n_groups[r]], gmax[r, : n_groups[r]]), r
    assert torch.equal(m.hist[:, 4], hist) and (hist.sum(1) > 0).all()

    class NotLaunched:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            raise AssertionError("the maxima were handed in")

    monkeypatch.setattr(tt, "_floor_max_kernel", NotLaunched())
    m = buffers(True)
    assert torch.equal(topk_select_triton(x, k, _poisoned(t, k), limits, maxima=m), want)
    with pytest.raises(ValueError, match="groups of"):
        topk_select_triton(x, k, None, limits, maxima=GroupMaxima(8, gmax, m.hist, False))


def test_sparse_blocks_take_single_atomics() -> None:
    """Blocks whose keys sharing the bytes found so far number at most `SPARSE_KEYS` add them
    one atomic each, the others a block histogram: both ways (and none, every block a
    histogram) give the reference's picks, on spread and on heavily tied rows."""
    from hisparse.attention import topk_triton as tt

    x = torch.cat([_rows(2, 9000, seed=11), torch.randint(0, 5, (2, 9000)).float()])
    saved = tt.SPARSE_KEYS
    try:
        for sparse in (0, 8, tt.BLOCK):
            tt.SPARSE_KEYS = sparse
            for k in (1, 700, 2048):
                got = topk_select_triton(x, k, _poisoned(4, k), parts=3)
                assert torch.equal(got, topk_select_reference(x, k)), (sparse, k)
    finally:
        tt.SPARSE_KEYS = saved


def test_empty_calls() -> None:
    assert topk_select_triton(torch.empty(0, 10), 4).shape == (0, 4)
    assert topk_select_triton(torch.full((2, 5), float("-inf")), 3).tolist() == [[-1] * 3] * 2


def test_largest_decode_row() -> None:
    """A 128K-token request's row at the block table's capacity, ``top_k`` 2048."""
    x = _rows(2, 131168, seed=5)
    got = topk_select_triton(x, 2048, out=_poisoned(2, 2048))
    assert torch.equal(got, topk_select_reference(x, 2048))


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_indexer_with_the_select(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged indexer's top-k with the Triton select passes the reference's check: decode
    tokens, a prefill chunk and padding tokens."""
    monkeypatch.setenv("HISPARSE_TOPK", "triton")
    case = ic.random_indexer_case(
        kind, [24, 60, 41, 130], [24, 9, 1, 1], heads=16, head_dim=64, block_size=8,
        device="cpu", seed=31, pad_tokens=2, extra_blocks=2,
    )  # fmt: skip
    top_k = 16
    small = it.IndexerConfig(block_n=16)
    out = it.indexer_topk_paged_triton(*case.args(), top_k, case.softmax_scale, config=small)
    ref = ic.reference_scores(case, case.block_table.shape[1] * 8)
    tol = ic.score_tolerance(ref, 1e-5, 1e-6)
    assert ic.selection_errors(out, ref, case.limits, top_k, tol) == []
    want = ir.indexer_topk_paged_reference(*case.args(), case.seq_lens, top_k, case.softmax_scale)
    monkeypatch.setenv("HISPARSE_TOPK", "reference")
    torch_topk = it.indexer_topk_paged_triton(*case.args(), top_k, case.softmax_scale, config=small)
    assert torch.equal(out.sort(dim=1).values, torch_topk.sort(dim=1).values)
    assert ic.selection_errors(want, ref, case.limits, top_k, tol) == []
