"""Triton GQA decode indexer equals the torch path (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported. Every case draws fresh
random e4m3 keys in shuffled blocks (unwritten pages NaN bytes) and queries, with outputs and
scratch buffers poisoned first (NaN scratch, ``-7`` outputs), so every element read back must
have been written by the kernels.

What "equal" means (`gqa_indexer_cases.selection_errors`): rows that fit in ``top_k`` exactly
the dense list; scored rows ascending, ``-1`` only as a suffix, as many picks as the torch path,
every forced position, and any position chosen by only one of the two a candidate whose
reference score is within ``1e-6 + 1e-5 * kth`` of the k-th kept score (under the interpreter
the dots are fp32, so the masses differ by summation order only: checked directly on the
kernel's mass scratch row at the same tolerance).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import dispatch, triton_split
from hisparse.attention import gqa_indexer_keys as gk
from hisparse.attention import gqa_indexer_reference as gr
from hisparse.attention import gqa_indexer_select as gs
from hisparse.attention import gqa_indexer_triton as git
from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.testing import gqa_indexer_cases as gcases

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)

RTOL, ATOL = 1e-5, 1e-6
TOP_K = 24
CFG = gr.GqaIndexerConfig(top_k=TOP_K, sink_tokens=2, recent_window=8)
SCALE = 0.25


@pytest.fixture
def scratch() -> Iterator[list]:
    """NaN-poisoned scratch buffers; the list collects them so a test can read the masses."""
    with gcases.poisoned_scratch() as seen:
        yield seen


def _run(case: gcases.DecodeCase, width: int, scratch: list, cfg=CFG, **kw) -> torch.Tensor:
    """Kernel vs torch path on one case: selections and candidate masses."""
    r = case.q.shape[0]
    out = torch.full((r, width), -7, dtype=torch.int32)
    got = git.gqa_indexer_topk_decode_triton(*case.args(), cfg, SCALE, width, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert not bool((got == -7).any()), "an output element was not written"
    want = dispatch.gqa_indexer_topk_decode(*case.args(), cfg, SCALE, width)  # CPU: torch path
    ref = gcases.reference_scores(case, cfg, SCALE)
    assert gcases.selection_errors(got, want, case, cfg, ref, RTOL, ATOL) == []
    # The kernel's candidate masses themselves (its scratch row) match the reference's.
    scored = 0
    masses = scratch[-1][2]
    for i, n in enumerate(case.lengths.tolist()):
        if n <= cfg.top_k:
            continue
        pos = int(case.positions[i])
        lo, hi = cfg.sink_tokens, max(pos - cfg.recent_window + 1, cfg.sink_tokens)
        if hi > lo:
            torch.testing.assert_close(masses[i, lo:hi], ref[i][lo:hi], rtol=RTOL, atol=ATOL)
            scored += 1
    return torch.tensor(scored)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_varied_lengths_capacity_bound(scratch: list, q_dtype: torch.dtype) -> None:
    """Scored and dense requests in one step; ``longest`` is the table capacity (CUDA-graph
    case: past every length); lengths just above top_k (one or two candidates dropped) and a
    request whose candidates start right after the sinks; pages strided inside a pool."""
    lengths = [70, 20, 45, 25, 100, 26, 24, 33]
    case = gcases.random_decode_case(
        lengths, head_dim=16, block_size=8, capacity=136, q_dtype=q_dtype, strided=True,
        seed=int(torch.randint(0, 2**31, ())),
    )  # fmt: skip
    cfg = git.GqaIndexerTritonConfig(block_n=16, chunk=32)
    assert int(_run(case, TOP_K, scratch, config=cfg)) == 6


def test_tile_by_tile_search_and_padding_columns(scratch: list) -> None:
    """Candidates beyond one ``BLOCK_S`` tile (the search loops over tiles), output wider than
    ``top_k`` (``-1`` columns), longest = the longest request."""
    case = gcases.random_decode_case(
        [150, 90, 10], head_dim=16, block_size=16, seed=int(torch.randint(0, 2**31, ()))
    )
    cfg = git.GqaIndexerTritonConfig(block_n=16, chunk=64, block_s=32, block_m=32, block_w=16)
    assert int(_run(case, TOP_K + 5, scratch, config=cfg)) == 2


def test_ties_keep_the_lowest_positions(scratch: list) -> None:
    """Every key equal: every candidate has the same mass, so the tie rule alone decides:
    the sinks, the first ``top_k - forced`` candidates, the recent window. Small integer
    keys and queries make every dot exact, so no summation order can break the tie."""
    n = 60
    case = gcases.random_decode_case([n, n], head_dim=16, block_size=8, seed=3)
    case.q = torch.randint(-3, 4, case.q.shape).float()
    key = torch.randint(-2, 3, (case.fmt.row_bytes,)).float()
    row = key.to(gk.FP8_DTYPE).view(torch.uint8)
    for b in range(n // 8 + 1):
        for tbl in case.tables:
            case.pages[int(tbl[b])].view(-1, case.fmt.row_bytes)[:] = row
    _run(case, TOP_K, scratch)
    got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K)
    sinks, window = CFG.sink_tokens, CFG.recent_window
    need = TOP_K - sinks - window
    expect = list(range(sinks + need)) + list(range(n - window, n))
    assert got[0].tolist() == expect and got[1].tolist() == expect


def test_all_dense_requests(scratch: list) -> None:
    """Every request fits in top_k while the host bound does not: all rows dense."""
    case = gcases.random_decode_case([5, 24, 17], head_dim=16, block_size=8, capacity=64, seed=4)
    got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K)
    assert torch.equal(got, gs.dense_topk(case.positions, TOP_K))


@pytest.mark.parametrize("capacity", [136, 16])  # scored rows / every row dense (host bound)
def test_rows_without_keys_select_nothing(scratch: list, capacity: int) -> None:
    """A fixed-shape step's padding rows (``lengths == 0``, position 0) select nothing on the
    kernel path, the torch path and the dense early-out of both: no row reaches the swap-in."""
    case = gcases.random_decode_case(
        [70, 1, 20, 1] if capacity > 16 else [9, 1, 12, 1], head_dim=16, block_size=8,
        capacity=capacity, seed=int(torch.randint(0, 2**31, ())),
    )  # fmt: skip
    case.lengths[[1, 3]] = 0
    case.positions[[1, 3]] = 0
    got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K)
    want = gr.gqa_indexer_topk_decode_reference(*case.args(), CFG, SCALE, TOP_K)
    for out in (got, want):
        assert bool((out[[1, 3]] == -1).all())
        assert bool((out[[0, 2], 0] == 0).all())  # the real rows keep their sink / first key
    assert torch.equal(got[[1, 3]], want[[1, 3]])


def test_dispatch_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HISPARSE_GQA_INDEXER=triton`` routes `gqa_indexer_topk_decode` to the kernels (on a
    CPU only under the interpreter), ``reference`` keeps the torch path."""
    case = gcases.random_decode_case([40, 30], head_dim=16, block_size=8, seed=5)
    calls: list[int] = []
    real = git.gqa_indexer_topk_decode_triton

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(git, "gqa_indexer_topk_decode_triton", counted)
    monkeypatch.setenv("HISPARSE_GQA_INDEXER", "triton")
    via = dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)
    assert calls == [1]
    monkeypatch.setenv("HISPARSE_GQA_INDEXER", "reference")
    torch_path = dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)
    assert calls == [1]
    ref = gcases.reference_scores(case, CFG, SCALE)
    assert gcases.selection_errors(via, torch_path, case, CFG, ref, RTOL, ATOL) == []


class _Grids:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_scratch_past_the_bound_runs_in_request_blocks(
    scratch: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scratch past `SCRATCH_BLOCK_BYTES` (1 GiB; lowered to two requests' worth here): the
    requests run in blocks of about equal size over one scratch allocation, every output
    element written, equal to one launch pair over the whole batch."""
    lengths = [70, 20, 45, 100, 33]
    case = gcases.random_decode_case(lengths, head_dim=16, block_size=8, capacity=136, seed=6)
    cfg = git.GqaIndexerTritonConfig(block_n=16, chunk=32)
    whole = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K, config=cfg)
    h, longest = case.q.shape[1], case.longest
    per_req = 4 * (h + 1) * longest + 8 * (-(-longest // 32)) * h
    monkeypatch.setattr(git, "SCRATCH_BLOCK_BYTES", 2 * per_req)
    spy = _Grids(git._gqa_select_kernel)
    monkeypatch.setattr(git, "_gqa_select_kernel", spy)
    out = torch.full((len(lengths), TOP_K), -7, dtype=torch.int32)
    got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K, config=cfg, out=out)
    assert spy.grids == [(2,), (2,), (1,)]
    assert scratch[-1][0].shape[0] == 2, "one scratch allocation of one block"
    assert not bool((got == -7).any()), "an output element was not written"
    assert torch.equal(got, whole)
    want = dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)  # CPU: torch path
    ref = gcases.reference_scores(case, CFG, SCALE)
    assert gcases.selection_errors(got, want, case, CFG, ref, RTOL, ATOL) == []


def test_more_chunks_than_the_grid_takes(scratch: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """More key chunks than grid axis 1 takes (CUDA: 65535; lowered to 2 here): the chunks
    grow until the grid fits (the select kernel merges that many chunk statistics)."""
    monkeypatch.setattr(triton_split, "MAX_GRID_YZ", 2)
    spy = _Grids(git._gqa_logits_kernel)
    monkeypatch.setattr(git, "_gqa_logits_kernel", spy)
    case = gcases.random_decode_case([70, 20, 130], head_dim=16, block_size=8, capacity=136, seed=7)
    cfg = git.GqaIndexerTritonConfig(block_n=16, chunk=32)
    assert int(_run(case, TOP_K, scratch, config=cfg)) == 2
    assert spy.grids == [(3, 2)]  # 136 positions: 128-key chunks
