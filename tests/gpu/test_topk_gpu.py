"""The Triton radix select on CUDA against `topk_select_reference`, at the engine's sizes:
decode batches of 1..64 rows and a prefill row block of 2048 rows, 32K and 128K keys (and the
block table's width past it), ``top_k`` 2048, with and without the floor from group maxima;
ties, causal limits, a poisoned output, and a CUDA graph replayed on new scores. Runs on the
GPU machine only (CI ignores ``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from hisparse.attention.topk_triton import topk_select_reference, topk_select_triton

DEV = torch.device("cuda")
K = 2048


def _rows(t: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, s, generator=g, device=DEV)
    x[:, : s // 5] = torch.relu(x[:, : s // 5])  # zeros: ties, as ReLU scores have
    return x


def _poisoned(t: int) -> torch.Tensor:
    return torch.full((t, K), -7777, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("t", [1, 2, 29, 64, 2048])
@pytest.mark.parametrize("s", [32768, 131072, 131168])
def test_rows_equal_the_reference(t: int, s: int) -> None:
    x = _rows(t, s, seed=t + s)
    limits = torch.randint(1, s + 1, (t,), device=DEV)
    limits[0] = s
    got = topk_select_triton(x, K, _poisoned(t), limits)
    assert torch.equal(got, topk_select_reference(x, K, limits))
    got = topk_select_triton(x, K, _poisoned(t))
    assert torch.equal(got, topk_select_reference(x, K))


@pytest.mark.parametrize("s", [32768, 131072])
@pytest.mark.parametrize("t", [8, 29])
def test_with_and_without_the_floor(t: int, s: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor from group maxima changes no pick: 29 rows of 128K keys (groups of 16) and,
    forced on, 8 rows and rows of 32K (groups of 4); crowded rows and a short one among them."""
    from hisparse.attention import topk_floor as tf

    monkeypatch.setattr(tf, "FLOOR_MIN_GROUP", 4)
    monkeypatch.setattr(tf, "FLOOR_MIN_ROWS", 8)
    x = _rows(t, s, seed=s + t)
    x[3] += 10.0  # crowded: one binade
    x[5, 40000 % s :] = float("-inf")
    want = topk_select_reference(x, K)
    assert torch.equal(topk_select_triton(x, K, _poisoned(t)), want)
    assert torch.equal(topk_select_triton(x, K, _poisoned(t), floor=False), want)


def test_heavy_ties_and_short_rows() -> None:
    x = torch.randint(0, 4, (8, 131072), device=DEV).float()
    x[3] = float("-inf")
    x[4, 100:] = float("-inf")  # fewer finite scores than K
    got = topk_select_triton(x, K, _poisoned(8))
    assert torch.equal(got, topk_select_reference(x, K))


def test_cuda_graph_replay() -> None:
    x = _rows(29, 131072, seed=3)
    pos = torch.randint(0, 131072, (29,), device=DEV)
    out = _poisoned(29)
    topk_select_triton(x, K, out, positions=pos)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_select_triton(x, K, out, positions=pos)
    for seed in (4, 5):
        x.copy_(_rows(29, 131072, seed=seed))
        pos.copy_(torch.randint(0, 131072, (29,), device=DEV))
        out.fill_(-7777)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_select_reference(x, K, pos + 1))
        # an eager call between replays shares the graph's zero-at-rest histograms
        y = _rows(5, 131072, seed=seed + 10)
        assert torch.equal(topk_select_triton(y, K, _poisoned(5)), topk_select_reference(y, K))
    from hisparse.attention import topk_radix as tr

    kept = tr._kept_hist[x.device]
    assert not kept[:, [0, 1, 2, 4, 5]].any()  # (the fourth: zeroed by the next call)
