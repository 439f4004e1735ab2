"""Triton GQA decode indexer on CUDA at SmolLM2-135M shapes against the torch path.

9 query heads, 3 KV heads, head dim 64, block size 64, top_k 256, 4 sinks, a 64-token window;
batch 1 and 64; contexts 556, 2048 and 8192, and the CUDA-graph bound (``longest`` = the
table's capacity, 8192, with 556-token requests). Runs on the GPU machine only (``pytest
tests/gpu``; CI ignores it). The torch path (``HISPARSE_GQA_INDEXER=reference``) runs on the same
GPU from the same bytes, fp32 without TF32. ``-k large``: 256 requests at a 128K capacity
(request blocks) and an 8.4M-position capacity (past grid axis 1).

Tolerance: the kernel's dot products are exact (e4m3 keys and bf16 query parts on the tensor
cores) and accumulate in fp32; its exp is the hardware approximation. Masses therefore differ
from the torch path's by rounding only; ``tol = 1e-6 + 1e-4 * kth`` (masses are at most 9) both
for the masses themselves and for `selection_errors` (any indexing or softmax bug moves a mass
by far more).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from hisparse.attention import dispatch
from hisparse.attention import gqa_indexer_reference as gr
from hisparse.attention import gqa_indexer_triton as git
from hisparse.testing import gqa_indexer_cases as gcases

DEV = torch.device("cuda")
H, G, D, BS, TOP_K = 9, 3, 64, 64, 256
CFG = gr.GqaIndexerConfig(top_k=TOP_K, sink_tokens=4, recent_window=64)
SCALE = D**-0.5
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(autouse=True)
def _torch_path_fp32(monkeypatch: pytest.MonkeyPatch):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.delenv("HISPARSE_GQA_INDEXER", raising=False)
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _lengths(batch: int, context: int, seed: int) -> list[int]:
    """Batch 1: the context. Larger batches: lengths from half the context up to it, the
    first and last exactly ``context``, and two requests that fit in top_k."""
    if batch == 1:
        return [context]
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g).tolist()
    lens[0] = lens[-1] = context
    lens[1], lens[2] = TOP_K, 100
    return lens


def _torch_path(case: gcases.DecodeCase, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setenv("HISPARSE_GQA_INDEXER", "reference")
    try:
        return dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)
    finally:
        monkeypatch.delenv("HISPARSE_GQA_INDEXER")


def _check(case: gcases.DecodeCase, monkeypatch: pytest.MonkeyPatch) -> None:
    out = torch.full((case.q.shape[0], TOP_K), -7, dtype=torch.int32, device=DEV)
    with gcases.poisoned_scratch() as seen:
        got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K, out=out)
    assert not bool((got == -7).any()), "an output element was not written"
    want = _torch_path(case, monkeypatch)
    ref = gcases.reference_scores(case, CFG, SCALE)
    assert gcases.selection_errors(got, want, case, CFG, ref, RTOL, ATOL) == []
    masses = seen[0][2].cpu()
    scored = 0
    for i, n in enumerate(case.lengths.tolist()):
        if n > TOP_K:
            hi = int(case.positions[i]) - CFG.recent_window + 1
            torch.testing.assert_close(
                masses[i, CFG.sink_tokens : hi], ref[i][CFG.sink_tokens : hi], rtol=RTOL,
                atol=ATOL,
            )  # fmt: skip
            scored += 1
    assert scored > 0


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("context", [556, 2048, 8192])
def test_matches_torch_path(
    monkeypatch: pytest.MonkeyPatch, context: int, batch: int, q_dtype: torch.dtype
) -> None:
    seed = int(torch.randint(0, 2**31, ()))
    case = gcases.random_decode_case(
        _lengths(batch, context, seed), heads=H, kv_heads=G, head_dim=D, block_size=BS,
        key_scale=3.0, q_dtype=q_dtype, strided=True, seed=seed, device=DEV,
    )  # fmt: skip
    _check(case, monkeypatch)


@pytest.mark.parametrize("batch", [1, 64])
def test_capacity_bound_matches_torch_path(monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """``longest`` = the table capacity (8192) while the requests hold ~556 keys."""
    seed = int(torch.randint(0, 2**31, ()))
    case = gcases.random_decode_case(
        _lengths(batch, 556, seed), heads=H, kv_heads=G, head_dim=D, block_size=BS,
        capacity=8192, key_scale=3.0, q_dtype=torch.bfloat16, seed=seed, device=DEV,
    )  # fmt: skip
    _check(case, monkeypatch)


def test_cuda_graph_replay_equals_eager() -> None:
    """The dispatch (`gqa_indexer_topk_decode` -> Triton) captured once at the capacity bound,
    replayed on new queries, keys and lengths: each replay equals an eager call."""
    batch, cap = 64, 2048
    # Captured at full capacity, so its page pool holds any later step's blocks.
    case = gcases.random_decode_case(
        [cap] * batch, heads=H, kv_heads=G, head_dim=D, block_size=BS, capacity=cap,
        q_dtype=torch.bfloat16, seed=1, device=DEV,
    )  # fmt: skip

    def step() -> torch.Tensor:
        return dispatch.gqa_indexer_topk_decode(*case.args(), CFG, SCALE, TOP_K)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (2, 3, 4):
        lens = _lengths(batch, 300 + 400 * seed, seed)
        fresh = gcases.random_decode_case(
            lens, heads=H, kv_heads=G, head_dim=D, block_size=BS, capacity=cap,
            q_dtype=torch.bfloat16, seed=seed, device=DEV,
        )  # fmt: skip
        # New contents in the captured tensors (same shapes: the table capacity is fixed).
        case.q.copy_(fresh.q)
        case.positions.copy_(fresh.positions)
        case.lengths.copy_(fresh.lengths)
        case.tables.copy_(fresh.tables)
        case.pages.fill_(0xFF)
        case.pages[: fresh.pages.shape[0]].copy_(fresh.pages)
        eager = step()
        graph.replay()
        torch.cuda.synchronize()
        assert int((eager >= 0).sum()) > 0
        assert torch.equal(static_out, eager)


class _Grids:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def _check_blocked(case: gcases.DecodeCase, monkeypatch: pytest.MonkeyPatch, want_case=None):  # type: ignore[no-untyped-def]
    """`_check` without the mass comparison (with request blocks the scratch holds the last
    block only): every output written, the torch path's selection (on ``want_case``, the
    same requests, if given), the launch grids returned."""
    logits, select = _Grids(git._gqa_logits_kernel), _Grids(git._gqa_select_kernel)
    out = torch.full((case.q.shape[0], TOP_K), -7, dtype=torch.int32, device=DEV)
    with monkeypatch.context() as m, gcases.poisoned_scratch():
        m.setattr(git, "_gqa_logits_kernel", logits)
        m.setattr(git, "_gqa_select_kernel", select)
        got = git.gqa_indexer_topk_decode_triton(*case.args(), CFG, SCALE, TOP_K, out=out)
        torch.cuda.synchronize()
    assert not bool((got == -7).any()), "an output element was not written"
    want = _torch_path(want_case or case, monkeypatch)
    ref = gcases.reference_scores(case, CFG, SCALE)
    assert gcases.selection_errors(got, want, case, CFG, ref, RTOL, ATOL) == []
    return logits.grids, select.grids


def test_large_batch_at_128k_capacity_runs_in_request_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 requests under a 128K capacity bound (CUDA graphs: ``longest`` is the capacity):
    1.3 GB of scratch, past `SCRATCH_BLOCK_BYTES` (1 GiB), so two blocks of 128 requests;
    one request holds the whole 128K context (tile-by-tile selection)."""
    lens = _lengths(256, 8192, seed=91)
    lens[3] = 131072
    case = gcases.random_decode_case(
        lens, heads=H, kv_heads=G, head_dim=D, block_size=BS, capacity=131072, key_scale=3.0,
        q_dtype=torch.bfloat16, seed=91, device=DEV,
    )  # fmt: skip
    _, select = _check_blocked(case, monkeypatch)
    assert select == [(128,), (128,)]


def test_large_capacity_past_the_grid_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capacity of 8.4M positions: more than 65535 chunks of the default 64 keys on grid
    axis 1, so the chunks grow; the selection is the torch path's at the real length."""
    cap = 65536 * 128 + 4096
    case = gcases.random_decode_case(
        [8192, 5000], heads=H, kv_heads=G, head_dim=D, block_size=BS, capacity=cap,
        key_scale=3.0, q_dtype=torch.bfloat16, seed=92, device=DEV,
    )  # fmt: skip
    logits, _ = _check_blocked(case, monkeypatch, dataclasses.replace(case, longest=8192))
    assert len(logits) == 1 and logits[0][1] <= 65535
