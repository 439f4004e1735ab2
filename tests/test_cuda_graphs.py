"""`DecodeGraphs.run`'s bookkeeping of the two kinds of decode step (general, and every page
resident), on the CPU with CUDA's graph capture stood in by a recorder: which steps run
eagerly, which are captured, and which replay."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hisparse.engine import cuda_graphs
from hisparse.engine.cuda_graphs import DecodeGraphs


class _Graph:
    """Stands in for `torch.cuda.CUDAGraph`: counts replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def graphs(monkeypatch):
    capturing = []

    @contextlib.contextmanager
    def graph(g):
        capturing.append(True)
        yield
        capturing.pop()

    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", graph)
    g = DecodeGraphs(8, torch.device("cpu"), capture=False)
    g.capture = True  # the CPU cannot capture: the recorder above does
    calls = []

    def step(b, resident):
        calls.append((b, resident, "captured" if capturing else "eager"))
        return torch.full((b, 1), float(resident)), torch.zeros((b, 3), dtype=torch.int64)

    return g, step, calls


def test_both_kinds_captured_at_a_size_first_seen(graphs) -> None:
    g, step, calls = graphs

    def keep_state():  # the hooks' state: copied before the step, put back before the repeat
        calls.append("kept")
        return lambda: calls.append("rewound")

    logits, _ = g.run(2, step, all_resident=True, both_kinds=True, keep_state=keep_state)
    # the step's own kind eagerly (its result), the general kind eagerly from the same hooks'
    # state (it compiles), both captured
    assert calls == ["kept", (2, True, "eager"), "rewound", (2, False, "eager"),
                     (2, True, "captured"), (2, False, "captured")]  # fmt: skip
    assert logits.eq(1.0).all()
    calls.clear()
    g.run(2, step, all_resident=False, both_kinds=True)  # a demoted request joined: replayed
    g.run(2, step, all_resident=True, both_kinds=True)
    assert calls == []
    assert g.graphs[2, False].replays == 1 and g.graphs[2, True].replays == 1
    assert g.steps == {2: 3} and g.steps_by_kind == {(2, True): 2, (2, False): 1}
    assert g.captured_sizes == [2]


def test_a_size_first_seen_with_demoted_requests_captures_the_general_kind_only(graphs) -> None:
    """The resident kind's step would compute wrong new rows on that batch: it waits for an
    all-resident batch of the size, and runs eagerly then."""
    g, step, calls = graphs
    keep = lambda: calls.append("kept") or (lambda: None)  # noqa: E731
    g.run(4, step, all_resident=False, both_kinds=True, keep_state=keep)
    assert calls == [(4, False, "eager"), (4, False, "captured")]
    calls.clear()
    g.run(4, step, all_resident=True, both_kinds=True, keep_state=keep)
    assert calls == [(4, True, "eager"), (4, True, "captured")]  # nothing to repeat
    assert sorted(g.graphs) == [(4, False), (4, True)]


def test_one_kind_where_the_other_never_runs(graphs) -> None:
    g, step, calls = graphs
    g.run(4, step)
    g.run(4, step)
    assert calls == [(4, False, "eager"), (4, False, "captured")]
    assert sorted(g.graphs) == [(4, False)]
