"""Triton lightning indexer equals the paged reference (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported. Every case draws fresh
random keys, queries, weights and a shuffled block table whose width exceeds the longest
request (so the score rows have a ``-inf`` tail), in both page formats (fp8 132-byte-style
rows with one scale per key, and the exact mode's fp32 rows).

What "equal" means (`indexer_cases.selection_errors`): scores agree with the reference to
``tol = 1e-6 + 1e-5 * max |score|`` of the token (the interpreter's dots are fp32, so only
the summation order differs; measured differences are ~1e-7 relative), ``-inf`` exactly past
each token's causal limit; the top-k has the right ``-1`` padding, distinct positions under
the limit, every pick within ``tol`` of the reference's k-th best score (in any order), and
exactly the reference's set wherever the k-th and (k+1)-th reference scores are
more than ``tol`` apart.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import dispatch, triton_split
from hisparse.attention import indexer_reference as ir
from hisparse.attention import indexer_triton as it
from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.testing import indexer_cases as ic

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)

RTOL, ATOL = 1e-5, 1e-6
SMALL = it.IndexerConfig(block_n=16)
#: Per-key block lookups (the first kernel's loop, which `OLD_FP8_CONFIG` keeps selectable).
SMALL_PER_KEY = it.IndexerConfig(block_n=16, page_tiles=False)


def _case(
    kind: str, contexts: list[int], queries: list[int], seed: int, **kw
) -> ic.PagedIndexerCase:
    opts = dict(heads=16, head_dim=64, block_size=8, device="cpu", seed=seed)
    opts.update(kw)
    return ic.random_indexer_case(kind, contexts, queries, **opts)


def _check(case: ic.PagedIndexerCase, top_k: int, **kw) -> torch.Tensor:
    """Scores and top-k of the kernel against the reference; returns the kernel's scores."""
    scores = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, **kw)
    assert scores.shape[1] == case.block_table.shape[1] * (
        case.pages.shape[1] // case.fmt.row_bytes
    )
    ref = ic.reference_scores(case, scores.shape[1])
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref)), "causal -inf mask differs"
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    finite = torch.isfinite(ref)
    assert torch.isfinite(scores[finite]).all()
    err = (scores - ref).abs().masked_fill(~finite, 0)
    assert (err <= tol).all(), f"max score error {float(err.max()):.3g} > tol"

    out = it.indexer_topk_paged_triton(*case.args(), top_k, case.softmax_scale, **kw)
    assert out.dtype == torch.int32 and out.shape == (case.q.shape[0], top_k)
    assert ic.selection_errors(out, ref, case.limits, top_k, tol) == []
    # The reference itself passes the same check (the checker agrees with the oracle).
    want = ir.indexer_topk_paged_reference(*case.args(), case.seq_lens, top_k, case.softmax_scale)
    assert ic.selection_errors(want, ref, case.limits, top_k, tol) == []
    return scores


# Block sizes 8 (tiles span pages: per-key lookups) and 32 (page tiles: one lookup per tile,
# whole tiles unmasked, the ragged one at the limit masked), and page tiles switched off on
# 32-key pages.
LOOPS = [(8, SMALL), (32, SMALL), (32, SMALL_PER_KEY)]
LOOP_IDS = ["bs8", "bs32-page-tiles", "bs32-per-key"]


@pytest.mark.parametrize("block_size,config", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_decode_contexts_shorter_and_longer_than_top_k(
    kind: str, block_size: int, config: it.IndexerConfig
) -> None:
    """One token per request; contexts from 1 key to several pages and several chunks."""
    contexts = [1, 9, 16, 17, 75, 130]
    case = _case(kind, contexts, [1] * 6, seed=1 + (kind == "exact"), block_size=block_size)
    _check(case, 16, config=config, chunk=32)


@pytest.mark.parametrize("block_size,config", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_prefill_chunks_mixed_with_decode(
    kind: str, block_size: int, config: it.IndexerConfig
) -> None:
    """Whole prompt, a later chunk of another request, a decode token, and padding tokens."""
    case = _case(
        kind, [24, 60, 41], [24, 9, 1], seed=10 + (kind == "exact"), pad_tokens=2,
        block_size=block_size, extra_blocks=2,
    )  # fmt: skip
    scores = _check(case, 16, config=config, chunk=32)
    assert torch.isneginf(scores[-2:]).all()


def test_config_rejects_unknown_dot_type() -> None:
    with pytest.raises(ValueError, match="dot"):
        it.IndexerConfig(dot="int8")


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_default_tile_shape_and_odd_head_count(kind: str) -> None:
    """Default config and chunk; 5 heads (padded to 16 inside the kernel), head_dim 32."""
    case = _case(kind, [70, 33], [2, 1], seed=20 + (kind == "exact"), heads=5, head_dim=32)
    _check(case, 8)


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(300 + seed)
    r = int(torch.randint(1, 4, (1,), generator=g))
    contexts = torch.randint(1, 90, (r,), generator=g).tolist()
    queries = [int(torch.randint(1, min(c, 4) + 1, (1,), generator=g)) for c in contexts]
    kind = ["fp8", "exact"][seed % 2]
    bs = [4, 8, 16][seed]
    case = _case(kind, contexts, queries, seed=seed, block_size=bs, extra_blocks=seed)
    _check(case, int(torch.randint(1, 40, (1,), generator=g)), config=SMALL, chunk=32)


def test_max_len_trims_the_score_columns() -> None:
    case = _case("fp8", [40, 21], [1, 1], seed=31, extra_blocks=3)
    full = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale)
    trimmed = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, max_len=40)
    assert trimmed.shape == (2, 40)
    assert torch.equal(trimmed, full[:, :40])
    assert torch.isneginf(full[:, 40:]).all()


def test_poisoned_outputs_are_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every score is written, also past the limits (NaN-filled allocations: topk would pick
    a NaN first, and the comparison would fail)."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    for kind in ("fp8", "exact"):
        case = _case(kind, [50, 7], [3, 1], seed=40, extra_blocks=2, pad_tokens=1)
        scores = _check(case, 16, config=SMALL, chunk=32)
        assert not torch.isnan(scores).any()


class _Grids:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN floats and ``-7777`` int32 / int64: unwritten elements
    show."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        if x.is_floating_point():
            return x.fill_(float("nan"))
        return x.fill_(-7777) if x.dtype in (torch.int32, torch.int64) else x

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_prefill_scored_in_row_blocks(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores past `SCORE_BLOCK_BYTES` (1 GiB; lowered to 3 rows here) run in row blocks of
    about equal size, each scoring only its tokens: every output element written (poisoned
    allocations), the picks of one un-blocked call, the reference's check passed. The
    reference, blocked the same way on its per-head logits, keeps its own result too."""
    case = _case(kind, [70, 40], [9, 2], seed=80 + (kind == "exact"), pad_tokens=1)
    top_k = 16
    whole = it.indexer_topk_paged_triton(*case.args(), top_k, case.softmax_scale, config=SMALL)
    ref_args = (*case.args(), case.seq_lens, top_k, case.softmax_scale)
    ref_whole = ir.indexer_topk_paged_reference(*ref_args)
    cols = it.score_cols(case.pages, case.fmt, case.block_table, None)
    monkeypatch.setattr(ir, "SCORE_BLOCK_BYTES", 3 * 4 * cols + 5)
    spy = _Grids(it._indexer_scores_kernel)
    monkeypatch.setattr(it, "_indexer_scores_kernel", spy)
    _poison_empty(monkeypatch)
    got = it.indexer_topk_paged_triton(*case.args(), top_k, case.softmax_scale, config=SMALL)
    assert [g[0] for g in spy.grids] == [3, 3, 3, 3]  # 12 tokens (one of them padding)
    assert len({g[1] for g in spy.grids}) == 1, "every block has the whole call's key chunks"
    assert torch.equal(got, whole)
    ref = ic.reference_scores(case, cols)
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    assert ic.selection_errors(got, ref, case.limits, top_k, tol) == []
    assert torch.equal(ir.indexer_topk_paged_reference(*ref_args), ref_whole)


def test_row_blocks_cover_the_rows_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ir, "SCORE_BLOCK_BYTES", 100)
    assert ir.score_row_blocks(0, 10) == []
    assert ir.score_row_blocks(10, 10) == [(0, 10)]
    assert ir.score_row_blocks(11, 10) == [(0, 6), (6, 11)]
    assert ir.score_row_blocks(3, 1000) == [(0, 1), (1, 2), (2, 3)]  # a row over the bound


def test_more_key_chunks_than_the_grid_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """More key chunks than grid axis 1 takes (CUDA: 65535; lowered to 3 here): the chunks
    grow until the grid fits; every score written, equal to the short-chunk launch."""
    case = _case("fp8", [90, 20], [2, 1], seed=85, extra_blocks=10)  # 176 score columns
    whole = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, config=SMALL,
                                           chunk=32)  # fmt: skip
    monkeypatch.setattr(triton_split, "MAX_GRID_YZ", 3)
    spy = _Grids(it._indexer_scores_kernel)
    monkeypatch.setattr(it, "_indexer_scores_kernel", spy)
    _poison_empty(monkeypatch)
    got = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, config=SMALL, chunk=32)
    assert whole.shape[1] > 3 * 32 and spy.grids == [(3, 3)]  # 64-key chunks
    assert torch.equal(got, whole)


def test_selection_checker_catches_wrong_picks() -> None:
    """The checker can fail: a swapped pick, a duplicate, a pick past the limit, bad padding."""
    case = _case("fp8", [40], [1], seed=50)
    ref = ic.reference_scores(case, 40)
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    good = it.topk_from_scores(ref, 8)
    assert ic.selection_errors(good, ref, case.limits, 8, tol) == []
    worst = int(ref[0].argmin())
    bad = good.clone()
    bad[0, 7] = worst
    assert any("below" in e for e in ic.selection_errors(bad, ref, case.limits, 8, tol))
    bad = good.clone()
    bad[0, 7] = bad[0, 0]
    assert any("twice" in e for e in ic.selection_errors(bad, ref, case.limits, 8, tol))
    assert ic.selection_errors(good.flip(1), ref, case.limits, 8, tol) == []  # any order
    bad = good.clone()
    bad[0, 7] = -1
    assert any("padding" in e for e in ic.selection_errors(bad, ref, case.limits, 8, tol))
    short = ic.reference_scores(case, 40)
    limits = torch.tensor([5])
    bad = it.topk_from_scores(ref, 8)  # ignores the 5-key limit
    assert ic.selection_errors(bad, short, limits, 8, tol)


def test_unsupported_inputs_are_refused() -> None:
    case = _case("fp8", [10], [1], seed=60)
    two_tiles = ir.IndexerCacheFormat("fp8", 256, 128)
    assert not it.supports(case.q, case.q_scale, case.pages, two_tiles)
    assert not it.supports(case.q.float(), case.q_scale, case.pages, case.fmt)  # not e4m3
    assert not it.supports(case.q, None, case.pages, case.fmt)
    with pytest.raises(ValueError, match="Triton indexer"):
        it.indexer_scores_paged_triton(
            case.q, None, case.weights, case.pages, case.fmt, case.block_table,
            case.req_index, case.positions, case.softmax_scale,
        )  # fmt: skip


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference on CPU by default; ``HISPARSE_INDEXER=triton`` forces the kernel; formats it
    does not handle fall back; a bad value is an error."""
    calls: list[int | None] = []
    real = it.indexer_topk_paged_triton

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw.get("max_len"))
        return real(*a, **kw)

    monkeypatch.setattr(it, "indexer_topk_paged_triton", spy)
    case = _case("exact", [30, 12], [1, 1], seed=70, extra_blocks=2)
    args = (*case.args(), case.seq_lens, 8, case.softmax_scale)
    monkeypatch.delenv("HISPARSE_INDEXER", raising=False)
    want = dispatch.indexer_topk_paged(*args)
    assert calls == []
    monkeypatch.setenv("HISPARSE_INDEXER", "triton")
    got = dispatch.indexer_topk_paged(*args)
    assert calls == [30], "the dispatch trims the scores to the longest request"
    ref = ic.reference_scores(case, 30)
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    assert ic.selection_errors(got, ref, case.limits, 8, tol) == []
    assert ic.selection_errors(want, ref, case.limits, 8, tol) == []
    wide = ir.IndexerCacheFormat("fp8", 256, 128)  # two scales per key: reference only
    big = _case("fp8", [9], [1], seed=71, head_dim=256)
    big.fmt = wide
    big.q_scale = torch.ones(1, 16, 2)
    dispatch.indexer_topk_paged(*big.args(), big.seq_lens, 4, big.softmax_scale)
    assert calls == [30]
    monkeypatch.setenv("HISPARSE_INDEXER", "bogus")
    with pytest.raises(ValueError, match="HISPARSE_INDEXER"):
        dispatch.indexer_topk_paged(*args)


@pytest.mark.parametrize("indexer_mode", ["exact", "fp8"])
def test_model_indexer_runs_through_the_kernel(
    indexer_mode: str, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny DeepSeek-V3.2 model picks the same rows (as sets) and gives the same logits
    with the kernel as with the reference, over a prefill chunk and two decode steps."""
    from hisparse.models import load_dsa_model
    from hisparse.models.deepseek_v32 import Indexer

    path = tiny_checkpoint("deepseek_v32", seed=3, num_hidden_layers=2)
    model = load_dsa_model(path, dtype=torch.float32, indexer_mode=indexer_mode)
    ids = torch.randint(0, 512, (22,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setenv("HISPARSE_INDEXER", backend)
        picks: list[torch.Tensor] = []
        hooks = [
            m.register_forward_hook(lambda _m, _i, out: picks.append(out))
            for m in model.modules()
            if isinstance(m, Indexer)
        ]
        cache = model.new_dense_cache(max_reqs=1, max_len=24, block_size=8)
        logits = []
        for start, n in ((0, 20), (20, 1), (21, 1)):
            step = cache.begin_step([0], [n])
            logits.append(model.logits(model(torch.tensor(ids[start : start + n]), step, cache)))
        for h in hooks:
            h.remove()
        return torch.cat(logits), picks

    ref_logits, ref_picks = run("reference")
    got_logits, got_picks = run("triton")
    assert len(got_picks) == len(ref_picks) == 6
    for a, b in zip(got_picks, ref_picks, strict=True):
        assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
    torch.testing.assert_close(got_logits, ref_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_pages_of_a_shared_pool_block_read_as_ordinary_pages(kind: str) -> None:
    """The GPU pool's indexer views: one layer's page is one of the indexer group's pages
    side by side, m of them to a block (docs/design.md §4.2), so the page view's stride is
    the group's page, not the layer's. The kernel reads it as a contiguous page tensor."""
    import dataclasses

    case = _case(kind, [40, 21], [2, 1], seed=91, extra_blocks=3)
    num_pages, page = case.pages.shape
    layers, layer = 3, 1  # this layer's page sits second in a group page of three
    pool = torch.full((num_pages * layers * page,), 255, dtype=torch.uint8)
    strided = pool.as_strided((num_pages, page), (layers * page, 1), layer * page)
    strided.copy_(case.pages)
    assert strided.stride(0) != page
    got = it.indexer_scores_paged_triton(
        *dataclasses.replace(case, pages=strided).args(), case.softmax_scale, config=SMALL
    )
    want = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, config=SMALL)
    assert torch.equal(got, want)
