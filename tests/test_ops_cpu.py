"""The CPU backend (`CpuBackend`) equals the reference exactly: outputs, state and errors.

What every backend must do (random and edge resolve cases, the gathers, the invalidation) runs
on this backend's forms and on Triton's in tests/test_ops_backends.py; here, what only the CPU
backend has: its batch-1 forms on batches of one query row, the reference's errors after the
same partial updates, invalid batches answered as the reference answers them, its dispatch.
Same method: fresh random inputs from the shared generators of `hisparse.testing.ops_cases`,
outputs poisoned first, every output and state tensor compared with ``torch.equal``; resolve
cases run several steps on the evolving hot state.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.runtime import ops as ops_pkg
from hisparse.runtime.ops import cpu_backend
from hisparse.runtime.ops import reference as ref
from hisparse.runtime.ops.cpu import ops as numpy_ops
from hisparse.testing.ops_cases import (
    POISON,
    ResolveCase,
    compare,
    make_invalidate_case,
    make_resolve_case,
    next_step_topk,
    random_paged_view,
)

cpu = cpu_backend()


def _run_both(case: ResolveCase, steps: int = 1, seed: int = 0, **kw: object) -> None:
    a, b = case.clone(), case.clone()
    for step in range(steps):
        if step:
            topk = next_step_topk(a, seed * 100 + step)
            for c in (a, b):
                c.topk = topk.clone()
                for t in (c.out_physical, c.swap_src, c.swap_dst, c.swap_count):
                    t.fill_(POISON + step)
        ref.resolve_residency(*a.args(), **kw)
        cpu.resolve_residency(*b.args(), **kw)
        bad = compare(a.state_and_outputs(), b.state_and_outputs())
        assert not bad, f"step {step}: {bad} differ"


def _pick(g: torch.Generator, xs: list) -> object:
    return xs[int(torch.randint(0, len(xs), (1,), generator=g))]


@pytest.fixture(
    params=["jit", "numpy", "batched"],
    ids=["one-request-jit", "one-request-numpy", "batched-path"],
)
def one_request_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with the CPU backend's form for batches with one live request (compiled, where
    numba is installed, and numpy) and without it (the batched form)."""
    if request.param == "jit" and cpu_backend().jit() is None:
        pytest.skip("numba is not installed (or HISPARSE_CPU_JIT=0)")
    monkeypatch.setattr(cpu, "one_request_path", request.param != "batched")
    monkeypatch.setattr(cpu, "jit_enabled", request.param == "jit")
    return request.param != "batched"


@pytest.mark.parametrize("seed", range(40))
def test_resolve_one_query_row(seed: int, one_request_path: bool) -> None:
    """Batches of one query row (batch-1 decode), live or not: the row's request padding,
    out of range or with a padding state slot, as well as ordinary ones."""
    g = torch.Generator().manual_seed(7000 + seed)
    K = _pick(g, [1, 4, 8, 16])
    case = make_resolve_case(
        Q=_pick(g, [1, 2, 3]), K=K, H=_pick(g, [16, 32]), block_size=_pick(g, [1, 2, 4]),
        seed=seed, max_rows=1, p_pad_row=0.0, p_pad_req=_pick(g, [0.0, 0.3]),
        p_neg=_pick(g, [0.0, 0.2]), p_dup=_pick(g, [0.0, 0.3]),
        p_resident_page=_pick(g, [0.0, 0.3]), hot_fill=_pick(g, [0.0, 0.6, 1.0]),
        reuse=_pick(g, [0.0, 0.8, 1.0]), with_resident=_pick(g, [True, False]),
        with_optional=_pick(g, [True, False]),
    )  # fmt: skip
    Q = case.request_state_indices.shape[0]
    q = int(_pick(g, [0, 0, 0, Q - 1, -1, Q]))  # mostly a real request
    case.row_req = torch.tensor([q], dtype=torch.int32)
    case.topk = next_step_topk(case, seed, reuse=0.5)[:1] if case.topk.shape[0] else case.topk
    if case.topk.shape[0] == 0:
        case.topk = torch.randint(-1, case.meta["n_pos"], (1, K), generator=g).int()
    extra = int(_pick(g, [0, 2]))
    case.out_physical = torch.full((1 + extra, K), POISON, dtype=torch.int32)
    if case.valid_counts is not None:
        case.valid_counts = torch.full((1 + extra,), POISON, dtype=torch.int32)
    _run_both(case, steps=4, seed=seed, max_rows_per_request=1)


@pytest.mark.parametrize("seed", range(4))
def test_resolve_decode_sizes(seed: int) -> None:
    """Closer to a real decode step: top-k 64, hot 192, 8 requests, block size 16."""
    case = make_resolve_case(
        Q=8, K=64, H=192, block_size=16, seed=seed, max_rows=2, p_dup=0.02, hot_fill=0.9
    )
    _run_both(case, steps=3, seed=seed, max_rows_per_request=2)


def test_resolve_strided_outputs_and_short_row_req() -> None:
    """Outputs as column slices of wider buffers (the runtime's ``physical[:rows, :k]``)."""
    case = make_resolve_case(Q=3, K=6, H=24, block_size=2, seed=21, max_rows=2)
    R = case.topk.shape[0]
    wide = torch.full((R + 3, 10), POISON, dtype=torch.int32)
    case.out_physical = wide[:, :6]
    _run_both(case, steps=3, seed=21)


def _errors_match(a: ResolveCase, b: ResolveCase, **kw: object) -> None:
    """Both raise the same error type and message and leave the same state behind."""
    with pytest.raises(Exception) as ea:
        ref.resolve_residency(*a.args(), **kw)
    with pytest.raises(Exception) as eb:
        cpu.resolve_residency(*b.args(), **kw)
    assert type(ea.value) is type(eb.value) and str(ea.value) == str(eb.value)
    assert not compare(a.state_and_outputs(), b.state_and_outputs())


def test_resolve_rejects_like_the_reference(one_request_path: bool) -> None:
    # More rows than max_rows_per_request for one request (after an earlier valid one).
    case = make_resolve_case(Q=3, K=4, H=16, block_size=2, seed=31, max_rows=3, p_pad_req=0.0)
    case.row_req = torch.tensor([0, 1, 1, 1, 2], dtype=torch.int32)
    case.topk = next_step_topk(case, 1)[:1].repeat(5, 1)
    case.out_physical = torch.full((5, 4), POISON, dtype=torch.int32)
    case.valid_counts = torch.full((5,), POISON, dtype=torch.int32)
    _errors_match(case.clone(), case.clone(), max_rows_per_request=2)
    # More distinct wanted rows than hot slots.
    case = make_resolve_case(
        Q=2, K=12, H=16, block_size=4, seed=32, max_rows=2, p_neg=0.0, p_dup=0.0,
        p_resident_page=0.0, p_pad_req=0.0, p_pad_row=0.0, reuse=0.0,
    )  # fmt: skip
    case.row_req = torch.tensor([0, 1, 1], dtype=torch.int32)
    n_pos = case.meta["n_pos"]
    g = torch.Generator().manual_seed(1)
    case.topk = torch.randperm(n_pos, generator=g)[:36].view(3, 12).to(torch.int32)
    case.out_physical = torch.full((3, 12), POISON, dtype=torch.int32)
    case.valid_counts = torch.full((3,), POISON, dtype=torch.int32)
    _errors_match(case.clone(), case.clone())
    case.row_req = torch.tensor([1, 1, 1], dtype=torch.int32)  # one request wants 36 > 16
    _errors_match(case.clone(), case.clone())
    # A position past the block table.
    case = make_resolve_case(Q=2, K=4, H=16, block_size=2, seed=33, max_rows=1, p_pad_req=0.0)
    case.row_req = torch.tensor([1, 0], dtype=torch.int32)
    case.topk = torch.tensor([[0, 1, 2, 3], [1, case.meta["n_pos"], 0, -1]], dtype=torch.int32)
    case.out_physical = torch.full((2, 4), POISON, dtype=torch.int32)
    case.valid_counts = torch.full((2,), POISON, dtype=torch.int32)
    _errors_match(case.clone(), case.clone())


def test_resolve_two_requests_on_one_slot_follow_the_reference() -> None:
    """Not a valid batch, but the answer must still be the reference's (request order)."""
    case = make_resolve_case(Q=3, K=4, H=16, block_size=2, seed=40, max_rows=2, p_pad_req=0.0)
    case.request_state_indices[2] = case.request_state_indices[0]
    _run_both(case, steps=2, seed=40)


# --- gathers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_gather_plan_within_one_view(seed: int) -> None:
    """Source and destination the same view (warm start): every read precedes every write."""
    g = torch.Generator().manual_seed(70 + seed)
    view = random_paged_view(12, 4, 32, 48, g)
    rows = torch.randperm(48, generator=g)
    src_rows, dst_rows = rows[:20].int(), rows[10:30].int()  # overlapping sets
    mask = (torch.rand(20, generator=g) < 0.8).int()
    a, b = view.clone(), view.clone()
    ref.gather_plan(a, a, src_rows, dst_rows, mask)
    cpu.gather_plan(b, b, src_rows, dst_rows, mask)
    assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(24))
def test_invalidate_one_written_row(seed: int) -> None:
    """One token written (batch-1 decode): padding request or row, a padding slot, a row
    the request holds or not; more request entries than written rows (or fewer)."""
    hot, state, row_req, written = make_invalidate_case(400 + seed, S=3, H=16, Q=2, n=1, rows=20)
    g = torch.Generator().manual_seed(seed)
    if seed % 3 == 0:  # the written row is one the request's slot holds
        s = int(state[0]) if int(state[0]) >= 0 else int(state[1])
        held = hot[s][hot[s] >= 0]
        row_req[0] = 0 if int(state[0]) >= 0 else 1
        if held.numel():
            written[0] = held[int(torch.randint(0, held.numel(), (1,), generator=g))]
    if seed % 4 == 1:
        row_req = row_req[:1]
    if seed % 5 == 2:
        written = torch.cat([written, torch.tensor([3], dtype=torch.int32)])  # past row_req
        row_req = row_req[:1]
    a, b = hot.clone(), hot.clone()
    ref.invalidate_written_slots(a, state, row_req, written)
    cpu.invalidate_written_slots(b, state, row_req, written)
    assert torch.equal(a, b)
    if seed % 3 == 0:
        assert not torch.equal(a, hot) or int(written[0]) < 0
    # A request past the state table; a state slot past the hot state: both raise.
    bad = [
        (state, torch.tensor([5], dtype=torch.int32)),
        (torch.tensor([7, 0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)),
    ]
    for bad_state, bad_req in bad:
        w = torch.tensor([1], dtype=torch.int32)
        with pytest.raises(IndexError):
            ref.invalidate_written_slots(hot.clone(), bad_state, bad_req, w)
        with pytest.raises(IndexError):
            cpu.invalidate_written_slots(hot.clone(), bad_state, bad_req, w)


@pytest.mark.parametrize("broadcast_max", [1 << 16, 0])
def test_invalidate_two_requests_on_one_slot_and_bad_request(
    broadcast_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(numpy_ops, "_INVALIDATE_BROADCAST_MAX", broadcast_max)
    hot, state, row_req, written = make_invalidate_case(99, S=3, Q=3)
    state[:] = torch.tensor([1, 1, 2], dtype=torch.int32)
    a, b = hot.clone(), hot.clone()
    ref.invalidate_written_slots(a, state, row_req, written)
    cpu.invalidate_written_slots(b, state, row_req, written)
    assert torch.equal(a, b)
    row_req[0], written[0] = 7, 3  # request 7 does not exist: both raise
    with pytest.raises(IndexError):
        ref.invalidate_written_slots(hot.clone(), state, row_req, written)
    with pytest.raises(IndexError):
        cpu.invalidate_written_slots(hot.clone(), state, row_req, written)


# --- dispatch --------------------------------------------------------------------------------


def test_cpu_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HISPARSE_OPS", raising=False)
    assert ops_pkg.ops_for("cpu") is cpu
    monkeypatch.setenv("HISPARSE_OPS", "reference")
    assert ops_pkg.ops_for("cpu") is ref
    monkeypatch.setenv("HISPARSE_OPS", "cpu")
    assert ops_pkg.ops_for("cpu") is cpu
    for name in ops_pkg.OP_NAMES:
        assert callable(getattr(cpu, name))


def test_backend_capabilities_are_declared_not_inherited_by_wrappers() -> None:
    """Capabilities come from each backend's own flags; a forwarding wrapper (the swap timer's)
    declares none, so the runtime's compiled CPU path, which skips the ops, stays off for it."""
    has = ops_pkg.has_capability
    assert has(cpu, "CPU_DECODE_FAST_PATH") and not has(cpu, "CUDA_GRAPH_CAPTURABLE")
    assert not has(ref, "CPU_DECODE_FAST_PATH") and not has(ref, "CUDA_GRAPH_CAPTURABLE")

    class Forwarding:
        def __init__(self, ops: object) -> None:
            self._ops = ops

        def __getattr__(self, name: str) -> object:
            return getattr(self._ops, name)

    wrapped = Forwarding(cpu)
    assert wrapped.CPU_DECODE_FAST_PATH is True  # forwarded as an attribute ...
    assert not has(wrapped, "CPU_DECODE_FAST_PATH")  # ... but not declared by the wrapper
    with pytest.raises(ValueError, match="capability"):
        has(cpu, "FAST")
