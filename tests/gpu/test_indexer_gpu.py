"""Triton lightning indexer on CUDA at DeepSeek-V3.2 sizes against the paged reference (on
Hopper its score stage runs the Gluon TMA kernel where that applies, `indexer_gluon`).

64 indexer heads x 128 dims, ``index_topk`` 2048, block size 64, contexts 4K..128K, batch
1..64 decode tokens and a 512-token prefill chunk; both page formats (fp8: 132-byte rows,
exact: fp32 rows). Runs on the GPU machine only (``pytest tests/gpu``; CI ignores it). The
reference runs on the same GPU in fp32 (TF32 off) from the same bytes. ``-k large``: an
8192-token prefill at 128K keys scored in row blocks, and an 8.4M-position table.

Tolerance: the kernel's products are exact (fp8 mode: e4m3 values fed to the tensor cores as
bf16; exact mode: fp32 FMA) and accumulate in fp32, so scores differ from the reference by
summation order only (~1e-6 relative). The check uses ``tol = 1e-6 + 1e-4 * max |score|`` of
each token, a tenfold margin over the interpreter's bar (any indexing or scale bug moves scores
by O(1)); `selection_errors` defines top-k equality against that tolerance (see its docstring).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from gpu_helpers import capture, poison_empty  # (tests/gpu is on sys.path under pytest)

from hisparse.attention import dispatch
from hisparse.attention import indexer_reference as ir
from hisparse.attention import indexer_triton as it
from hisparse.testing import indexer_cases as ic

DEV = torch.device("cuda")
H, D, K, BS = 64, 128, 2048, 64
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _case(kind: str, contexts: list[int], queries: list[int] | None = None, seed: int = 0,
          **kw) -> ic.PagedIndexerCase:  # fmt: skip
    queries = queries or [1] * len(contexts)
    return ic.random_indexer_case(
        kind, contexts, queries, heads=H, head_dim=D, block_size=BS, device=DEV, seed=seed, **kw
    )


def _check(case: ic.PagedIndexerCase, **kw) -> torch.Tensor:
    scores = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, **kw)
    out = it.indexer_topk_paged_triton(*case.args(), K, case.softmax_scale, **kw)
    torch.cuda.synchronize()
    ref = ic.reference_scores(case, scores.shape[1])
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref)), "causal -inf mask differs"
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    finite = torch.isfinite(ref)
    assert torch.isfinite(scores[finite]).all()
    err = (scores - ref).abs().masked_fill(~finite, 0)
    worst = float((err / tol).max())
    assert worst <= 1.0, f"score error {worst:.3g} x tol"
    assert ic.selection_errors(out, ref, case.limits, K, tol) == []
    return out


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_decode_batch_1_at_128k(kind: str) -> None:
    _check(_case(kind, [131072], seed=1))


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_decode_batch_8_mixed_contexts(kind: str) -> None:
    """4K..128K, one shorter than top_k, one not a multiple of the block size; table wider
    than the longest request (a -inf tail)."""
    contexts = [4096, 1000, 16384, 32768, 65536 + 17, 131072, 8192, 2049]
    _check(_case(kind, contexts, seed=2, extra_blocks=3, pad_tokens=1))


def test_decode_batch_64_fp8() -> None:
    g = torch.Generator().manual_seed(3)
    contexts = torch.randint(4096, 131073, (64,), generator=g).tolist()
    _check(_case("fp8", contexts, seed=3))


@pytest.mark.parametrize("kind", ["fp8", "exact"])
def test_prefill_chunk_and_decode(kind: str) -> None:
    """A 512-token chunk of an 8K prompt packed with two decode tokens."""
    _check(_case(kind, [8192, 32768, 3000], [512, 1, 1], seed=4))


def test_bf16_queries_in_exact_mode() -> None:
    """The model's bf16 q reaches the exact-mode kernel as is (converted to fp32 inside)."""
    case = _case("exact", [20000, 3000], seed=5)
    case.q = case.q.bfloat16()
    _check(case)


#: bench_indexer.py's swept configs with exact (f16 / bf16) dots: any of them may become the
#: default, so each is held to the same tolerance (the fp8-dot ones are measured, not held).
SWEPT = {
    "old": it.OLD_FP8_CONFIG,
    "f16_perkey_s3": it.IndexerConfig(page_tiles=False, num_stages=3),
    "f16_perkey_s5": it.IndexerConfig(page_tiles=False, num_stages=5),
    "bf16_page_s5": it.IndexerConfig(dot="bf16"),
    "page_s3": it.IndexerConfig(num_stages=3),
    "page_s4": it.IndexerConfig(num_stages=4),
    "page_s7": it.IndexerConfig(num_stages=7),
}


@pytest.mark.parametrize("name", list(SWEPT))
def test_swept_config_decode_and_prefill(name: str) -> None:
    """Mixed contexts with padding and a -inf tail, then a prefill chunk with decode tokens."""
    contexts = [4096, 1000, 16384, 32768, 65536 + 17, 131072, 8192, 2049]
    _check(_case("fp8", contexts, seed=12, extra_blocks=3, pad_tokens=1), config=SWEPT[name])
    _check(_case("fp8", [8192, 32768, 3000], [512, 1, 1], seed=13), config=SWEPT[name])


@pytest.mark.parametrize("chunk", [64, 192, 16384])
def test_default_config_with_other_chunks(chunk: int) -> None:
    """Keys per program from one tile to a whole 16K run, not a power of two in between."""
    contexts = [20000, 131072, 777, 65536]
    _check(_case("fp8", contexts, seed=14, extra_blocks=2), chunk=chunk)


def test_dispatch_picks_the_kernel_and_trims() -> None:
    case = _case("fp8", [40000, 9000], seed=6, extra_blocks=200)
    args = (*case.args(), case.seq_lens, K, case.softmax_scale)
    got = dispatch.indexer_topk_paged(*args)
    want = ir.indexer_topk_paged_reference(*args)
    ref = ic.reference_scores(case, 40000)
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    assert ic.selection_errors(got, ref, case.limits, K, tol) == []
    assert ic.selection_errors(want, ref, case.limits, K, tol) == []


def test_cuda_graph_replay_matches_eager() -> None:
    """The whole top-k (score kernel + torch.topk) captures and replays on new inputs."""
    case = _case("fp8", [32768] * 8, seed=7)
    static_q = case.q.clone()

    def call() -> torch.Tensor:
        return it.indexer_topk_paged_triton(
            static_q, case.q_scale, case.weights, case.pages, case.fmt, case.block_table,
            case.req_index, case.positions, K, case.softmax_scale,
        )  # fmt: skip

    call()  # compile outside the capture
    graph, static_out = capture(call)
    fresh = _case("fp8", [32768] * 8, seed=8)
    static_q.copy_(fresh.q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, call())


def _lift_pages(case: ic.PagedIndexerCase, above: int) -> ic.PagedIndexerCase:
    """The case's pages moved to the top of a pool whose first ``above`` bytes are never read
    (the block table renumbered): every key read lies past byte ``above``."""
    nb, pb = case.pages.shape
    skip = -(-above // pb)
    pool = torch.full((skip + nb, pb), 0xFF, dtype=torch.uint8, device=DEV)  # NaN keys
    pool[skip:] = case.pages
    return dataclasses.replace(case, pages=pool, block_table=case.block_table + skip)


#: The large prefill chunk: its last 8192 query tokens at a 128K context (``[T, S]`` scores
#: of 4 GiB: four row blocks under the default 1 GiB bound), pages past byte 2^32.
LARGE_T, LARGE_S, HIGH_BYTE = 8192, 131072, 2**32


def test_large_prefill_chunk_scored_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocked top-k (poisoned allocations) equals the top-k of the whole ``[T, S]``
    scores, holds at most about one block of scores at a time (peak allocation), and 16
    sampled tokens, block borders among them, pass the reference's score and selection
    checks."""
    case = _lift_pages(_case("fp8", [LARGE_S], [LARGE_T], seed=21), HIGH_BYTE)
    cols = LARGE_S  # max_len, as the dispatcher passes it (the table has one block more)
    blocks = ir.score_row_blocks(LARGE_T, 4 * cols)
    assert len(blocks) > 1
    scores = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, max_len=cols)
    want = it.topk_from_scores(scores, K)
    picks = torch.randint(0, LARGE_T, (8,), generator=torch.Generator().manual_seed(21))
    borders = [0, LARGE_T - 1] + [b for lo, hi in blocks[1:] for b in (lo - 1, lo)]
    s = torch.tensor(sorted({*borders, *picks.tolist()}), device=DEV)
    sampled = scores[s]
    del scores
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with monkeypatch.context() as m:
        poison_empty(m, ints=True)
        got = it.indexer_topk_paged_triton(*case.args(), K, case.softmax_scale, max_len=cols)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base  # un-blocked: 4 GiB of scores alone
    assert peak < 1.5 * ir.SCORE_BLOCK_BYTES, f"peak {peak / 2**30:.2f} GiB"
    assert torch.equal(got, want)
    sub = dataclasses.replace(
        case, q=case.q[s], q_scale=case.q_scale[s], weights=case.weights[s],
        req_index=case.req_index[s], positions=case.positions[s],
    )  # fmt: skip
    ref = ic.reference_scores(sub, cols)
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    assert torch.equal(torch.isneginf(sampled), torch.isneginf(ref))
    err = (sampled - ref).abs().masked_fill(~torch.isfinite(ref), 0)
    assert float((err / tol).max()) <= 1.0
    assert ic.selection_errors(got[s], ref, sub.limits, K, tol) == []


def test_large_table_past_the_grid_limit() -> None:
    """A block table of 8.4M positions: more than 65535 key chunks of 128 on grid axis 1,
    so the chunks grow; scores and top-k still match the reference (pages past byte 2^31)."""
    case = _case("fp8", [8192, 3000], seed=22, extra_blocks=131072)
    case = _lift_pages(case, 2**31)
    cols = case.block_table.shape[1] * BS
    assert -(-cols // 128) > 65535
    _check(case, chunk=128)


def _kernel_name(compiled) -> str:  # type: ignore[no-untyped-def]
    return compiled.name if hasattr(compiled, "name") else compiled.metadata.name


@pytest.mark.parametrize(("heads", "block_size"), [(64, 64), (32, 64), (128, 64), (64, 256)])
def test_gluon_kernel_taken_and_beside_triton(
    monkeypatch: pytest.MonkeyPatch, heads: int, block_size: int
) -> None:
    """The default call on sm_90 runs the Gluon TMA kernel (poisoned outputs: every score is
    written); its scores pass the reference's checks and equal the Triton kernel's (the
    default config passed explicitly) bit for bit: the same f16 products, summed by the same
    wgmma instructions in the same order. Heads: GLM-5's 32, DeepSeek's 64, the most a
    program takes; 256-key pages put four tiles in a page."""
    from hisparse.attention import indexer_gluon as ig

    if not ig.supported(DEV):
        pytest.skip("the Gluon kernel needs sm_90")
    contexts = [4096, 1000, 16384, 32768, 65536 + 17, 131072, 8192, 2049] * 3 + [300, 64, 65]
    case = ic.random_indexer_case(
        "fp8", contexts, [1] * len(contexts), heads=heads, head_dim=D, block_size=block_size,
        device=DEV, seed=31 + heads, extra_blocks=3, pad_tokens=2,
    )  # fmt: skip
    with monkeypatch.context() as m:
        poison_empty(m, ints=True)
        got = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale)
        assert "gluon" in _kernel_name(it.last_compiled[0])
        want = it.indexer_scores_paged_triton(
            *case.args(), case.softmax_scale, config=it.IndexerConfig()
        )
        assert "gluon" not in _kernel_name(it.last_compiled[0])
    torch.cuda.synchronize()
    ref = ic.reference_scores(case, got.shape[1])
    tol = ic.score_tolerance(ref, RTOL, ATOL)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(got[finite]).all()
    assert float(((got - ref).abs().masked_fill(~finite, 0) / tol).max()) <= 1.0
    assert torch.equal(got, want)
    assert ic.selection_errors(it.topk_from_scores(got, K), ref, case.limits, K, tol) == []


def test_gluon_kernel_writes_the_top_k_group_maxima(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a decode batch the top-k takes a floor for (29 requests of up to 128K keys and a
    padding token) the Gluon score kernel writes the floor's group maxima and their first-byte
    histogram beside the scores (poisoned buffers first): equal to `group_maxima_reference`
    on its own scores up to each row's limit. The select reading them picks what the
    reference picks, and the indexer's top-k (which hands them over) passes its check."""
    from hisparse.attention import indexer_gluon as ig
    from hisparse.attention import topk_floor as tf
    from hisparse.attention import topk_triton as tt

    if not ig.supported(DEV):
        pytest.skip("the Gluon kernel needs sm_90")
    g = torch.Generator().manual_seed(52)
    contexts = [*torch.randint(2049, 131073, (27,), generator=g).tolist(), 131072, 1000]
    case = _case("fp8", contexts, seed=52, pad_tokens=1)
    t = case.q.shape[0]
    cols = it.score_cols(case.pages, case.fmt, case.block_table, None)
    maxima = tf.group_maxima(t, cols, K, DEV)
    assert maxima is not None and maxima.group == tf.FLOOR_GROUP
    hist = torch.zeros((t, tt.HISTS, tt.BINS), dtype=torch.int32, device=DEV)
    maxima = dataclasses.replace(maxima, gmax=torch.full_like(maxima.gmax, 12345), hist=hist,
                                 clear=False)  # fmt: skip
    scores = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale, maxima=maxima)
    assert maxima.filled and "gluon" in _kernel_name(it.last_compiled[0])
    torch.cuda.synchronize()
    limits = case.limits
    want_g, want_h = tf.group_maxima_reference(scores, maxima.group, limits)
    n_groups = ((limits + maxima.group - 1) // maxima.group).tolist()
    for r in range(t):
        assert torch.equal(maxima.gmax[r, : n_groups[r]], want_g[r, : n_groups[r]]), r
    assert torch.equal(hist[:, 4], want_h)
    got = it.topk_from_scores(
        scores, K, positions=case.positions, req_index=case.req_index, maxima=maxima
    )
    assert torch.equal(got, tt.topk_select_reference(scores, K, limits))
    _check(case)


def test_unaligned_pages_fall_back_to_triton() -> None:
    """Pages at an address a TMA descriptor cannot take (4 bytes past 16-byte alignment) are
    not the Gluon kernel's (the same pages aligned are) and still match the reference."""
    from hisparse.attention import indexer_gluon as ig

    if not ig.supported(DEV):
        pytest.skip("the Gluon kernel needs sm_90")
    case = _case("fp8", [20000, 131072], seed=41)
    assert ig.usable(case.q, case.q_scale, case.pages, case.fmt, True)
    nb, pb = case.pages.shape
    pool = torch.empty(nb * pb + 16, dtype=torch.uint8, device=DEV)
    pages = pool[4 : 4 + nb * pb].view(nb, pb)
    pages.copy_(case.pages)
    assert not ig.usable(case.q, case.q_scale, pages, case.fmt, True)
    _check(dataclasses.replace(case, pages=pages))
