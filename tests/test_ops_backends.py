"""Every data-plane op backend equals the reference exactly: outputs and state.

The backends: the CPU backend (`CpuBackend`) with its form for batches of one live request
compiled (numba) and in numpy and without it (the batched form), and the Triton kernels in
Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before Triton is imported). Each test
runs on each backend, on the same fresh random inputs from `hisparse.testing.ops_cases`:
outputs poisoned first, every output and state tensor compared with ``torch.equal``; resolve
cases run several steps on the evolving hot state. A backend that adds the hits, misses and
rows moved to running totals itself (``RESOLVE_ADDS_TOTALS``: Triton) is checked against the
reference's per-request counters summed. What only one backend has (the CPU backend's errors
and batch-1 forms, the Triton resolve's kernels and knobs) is tested in test_ops_cpu.py and
test_ops_triton.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hisparse.runtime.ops import cpu_backend, has_capability
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

#: The resolve's backends: the CPU backend's three forms, then Triton.
RESOLVE = ("cpu-jit", "cpu-numpy", "cpu-batched", "triton")
#: The gathers' backends: the CPU backend merging block and row dimensions with
#: ``reshape(copy=False)`` and with `as_strided`, then Triton.
GATHER = ("cpu-reshape-view", "cpu-as-strided-view", "triton")
#: The invalidation's: the CPU backend comparing all pairs and matching sorted keys, Triton.
INVALIDATE = ("cpu-all-pairs", "cpu-sorted-keys", "triton")


def _backend(name: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The ops namespace ``name`` stands for, its switches set for this test."""
    if name == "triton":
        pytest.importorskip("triton")
        from hisparse.runtime.ops import triton_backend
        from hisparse.runtime.ops.triton_common import interpreting

        if not interpreting():
            pytest.skip("Triton kernels were defined outside the interpreter")
        return triton_backend
    cpu = cpu_backend()
    if name == "cpu-jit" and cpu.jit() is None:
        pytest.skip("numba is not installed (or HISPARSE_CPU_JIT=0)")
    if name == "cpu-reshape-view" and not numpy_ops._RESHAPE_HAS_COPY:
        pytest.skip("numpy < 2.1 has no reshape(copy=False)")
    if name in RESOLVE:
        monkeypatch.setattr(cpu, "one_request_path", name != "cpu-batched")
        monkeypatch.setattr(cpu, "jit_enabled", name == "cpu-jit")
    elif name in GATHER:
        monkeypatch.setattr(numpy_ops, "_RESHAPE_HAS_COPY", name == "cpu-reshape-view")
    else:
        broadcast = 1 << 16 if name == "cpu-all-pairs" else 0
        monkeypatch.setattr(numpy_ops, "_INVALIDATE_BROADCAST_MAX", broadcast)
    return cpu


@pytest.fixture(params=RESOLVE)
def resolve_ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return _backend(request.param, monkeypatch)


@pytest.fixture(params=GATHER)
def gather_ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return _backend(request.param, monkeypatch)


def run_both(ops, case: ResolveCase, steps: int = 1, seed: int = 0, **kw: object) -> None:  # type: ignore[no-untyped-def]
    """Reference and ``ops`` resolve over ``steps`` steps on clones of ``case``; a backend
    that adds running totals (``totals=``) is checked against the reference's counters."""
    a, b = case.clone(), case.clone()
    totals = None
    if has_capability(ops, "RESOLVE_ADDS_TOTALS"):
        totals = torch.full((3,), 5, dtype=torch.int64)  # running totals from a nonzero start
        want = totals.clone()
    for step in range(steps):
        if step:
            topk = next_step_topk(a, seed * 100 + step)
            for c in (a, b):
                c.topk = topk.clone()
                for t in (c.out_physical, c.swap_src, c.swap_dst, c.swap_count):
                    t.fill_(POISON + step)
        ref.resolve_residency(*a.args(), **kw)
        if totals is None:
            ops.resolve_residency(*b.args(), **kw)
        else:
            ops.resolve_residency(*b.args(), totals=totals, n_layers=3, **kw)
        bad = compare(a.state_and_outputs(), b.state_and_outputs())
        assert not bad, f"step {step}: {bad} differ"
        if totals is not None and a.hit_miss is not None:
            hm = a.hit_miss[: a.request_state_indices.shape[0]].long().sum(0)
            want += torch.stack((hm[0], hm[1], 3 * hm[1]))
            assert torch.equal(totals, want), f"step {step}: totals {totals} != {want}"
        # The oracle's invariants hold too (so the case exercises a valid state).
        for s in range(a.lru.shape[0]):
            assert torch.equal(torch.sort(a.lru[s].long()).values, torch.arange(a.lru.shape[1]))
            held = a.hot_index[s][a.hot_index[s] >= 0]
            assert held.unique().numel() == held.numel()


def _pick(g: torch.Generator, xs: list) -> object:
    return xs[int(torch.randint(0, len(xs), (1,), generator=g))]


# --- resolve ---------------------------------------------------------------------------------

#: Random resolve cases per backend: the CPU forms are cheap, the interpreter is not.
_RANDOM_CASES = [
    pytest.param(name, seed, id=f"{name}-{seed}")
    for name in RESOLVE
    for seed in range(24 if name == "triton" else 60)
]


@pytest.mark.parametrize(("backend", "seed"), _RANDOM_CASES)
def test_resolve_random_multistep(backend: str, seed: int, monkeypatch) -> None:
    ops = _backend(backend, monkeypatch)
    g = torch.Generator().manual_seed(5000 + seed)
    K = _pick(g, [1, 3, 4, 5, 8, 16])
    bs = _pick(g, [1, 2, 4, 8])
    H = _pick(g, [16, 20, 32, 48])
    case = make_resolve_case(
        Q=_pick(g, [1, 2, 3, 5, 8]),
        K=K,
        H=H,
        block_size=bs,
        seed=seed,
        max_rows=max(1, min(3, H // K)),
        p_neg=_pick(g, [0.0, 0.1, 0.3]),
        p_dup=_pick(g, [0.0, 0.1, 0.4]),
        p_resident_page=_pick(g, [0.0, 0.2, 0.5]),
        p_pad_req=_pick(g, [0.0, 0.3]),
        p_pad_row=_pick(g, [0.0, 0.2]),
        hot_fill=_pick(g, [0.0, 0.5, 1.0]),
        reuse=_pick(g, [0.0, 0.5, 0.9, 1.0]),
        with_resident=_pick(g, [True, False]),
        with_optional=_pick(g, [True, False]),
        extra_out_rows=_pick(g, [0, 2]),
        shuffle_rows=_pick(g, [True, False]),
        index_dtype=_pick(g, [torch.int32, torch.int64]),
        extra_req_rows=_pick(g, [0, 3]),  # per-request buffers sized for more requests
    )
    run_both(ops, case, steps=4 if backend != "triton" else 3, seed=seed)


@pytest.mark.parametrize(
    "kw",
    [
        dict(p_neg=1.0),  # nothing wanted: state untouched
        dict(p_resident_page=1.0),  # everything resident
        dict(p_pad_req=1.0),  # every request is padding
        dict(hot_fill=0.0, reuse=0.0),  # cold start: all misses
        dict(hot_fill=1.0, reuse=1.0, p_neg=0.0),  # mostly hits, full hot set
        dict(shuffle_rows=False, p_pad_row=0.0),
        dict(p_pad_row=1.0),  # many padding rows
    ],
)
def test_resolve_edges(kw: dict, resolve_ops) -> None:
    base = dict(Q=3, K=8, H=16, block_size=4, seed=7, max_rows=2)
    base.update(kw)
    run_both(resolve_ops, make_resolve_case(**base), steps=2, seed=7)


def test_resolve_wanted_fills_whole_hot_buffer(resolve_ops) -> None:
    """rows * top_k == H, all distinct, all misses: every slot is replaced."""
    K = 8
    case = make_resolve_case(
        Q=2, K=K, H=16, block_size=4, seed=3, max_rows=2, p_neg=0.0, p_dup=0.0,
        p_resident_page=0.0, p_pad_req=0.0, p_pad_row=0.0, hot_fill=1.0, reuse=0.0,
    )  # fmt: skip
    case.row_req = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    n_pos = case.meta["n_pos"]
    picks = torch.stack([torch.randperm(n_pos, generator=g)[: 2 * K] for _ in range(2)])
    case.topk = picks.view(2, 2, K).transpose(0, 1).reshape(4, K).to(torch.int32)
    case.out_physical = torch.full((4, K), POISON, dtype=torch.int32)
    case.valid_counts = torch.full((4,), POISON, dtype=torch.int32)
    run_both(resolve_ops, case, steps=1)


def test_resolve_hand_example(resolve_ops) -> None:
    """The reference test's worked example (tests/test_ops_reference.py)."""
    H = 8
    hot_index = torch.full((1, H), -1, dtype=torch.int32)
    lru = torch.arange(H, dtype=torch.int16).repeat(1, 1)
    out = torch.full((1, 5), 12345, dtype=torch.int32)
    src = torch.full((1, H), -7, dtype=torch.int32)
    dst = src.clone()
    cnt = torch.full((1,), 99, dtype=torch.int32)
    resolve_ops.resolve_residency(
        torch.tensor([[1, 5, 1, -1, 9]], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([[10, 11, 12]], dtype=torch.int32),
        torch.tensor([[0, 0, 7]], dtype=torch.int32),
        torch.tensor([[5, 6]], dtype=torch.int32),
        hot_index, lru, 4, out, src, dst, cnt,
    )  # fmt: skip
    assert out.tolist() == [[20, 21, 20, -1, 29]]
    assert cnt.tolist() == [2] and src[0, :3].tolist() == [41, 45, -7]
    assert dst[0, :2].tolist() == [20, 21]
    assert lru[0].tolist() == [2, 3, 4, 5, 6, 7, 0, 1]
    assert hot_index[0].tolist() == [41, 45, -1, -1, -1, -1, -1, -1]


# --- gathers ---------------------------------------------------------------------------------


def _swap(case: ResolveCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return case.swap_src, case.swap_dst, case.swap_count


@pytest.mark.parametrize("seed", range(9))
def test_gather_compact_matches_reference(seed: int, gather_ops) -> None:
    g = torch.Generator().manual_seed(seed)
    bs = [1, 2, 4, 16][seed % 4]
    rb = [16, 48, 80, 1536][seed % 4]
    Q = 1 if seed % 2 else 4  # one request: the batch-1 form
    case = make_resolve_case(Q=Q, K=8, H=24, block_size=bs, seed=seed, max_rows=2, p_pad_req=0)
    ref.resolve_residency(*case.args())  # the swap list past each count stays poisoned
    host = random_paged_view(
        int(case.source_block_table.max()) + 1, bs, rb, rb + 16 * (seed % 2), g
    )
    nd = int(case.hot_block_table.max()) + 1
    # Device pages padded apart, interleaved with other layers' pages, or one dense array
    # (rows then merge into one [blocks * block_size, row_bytes] view).
    if seed % 3 == 2:
        pool = torch.randint(0, 256, (nd, 3, bs, rb), dtype=torch.uint8, generator=g)
        dev_a, dev_b = pool[:, 1], pool.clone()[:, 1]
    elif seed % 3 == 1:
        dev_a = torch.randint(0, 256, (nd, bs, rb), dtype=torch.uint8, generator=g)
        dev_b = dev_a.clone()
    else:
        dev_a = random_paged_view(nd, bs, rb, rb, g)
        dev_b = dev_a.clone()
    before = dev_a.clone()
    ref.gather_compact(host, dev_a, *_swap(case))
    gather_ops.gather_compact(host, dev_b, *_swap(case))
    assert torch.equal(dev_a, dev_b)
    assert int(case.swap_count.sum()) == 0 or not torch.equal(dev_a, before)
    # Negative counts list nothing.
    case.swap_count.fill_(-3)
    ref.gather_compact(host, dev_a, *_swap(case))
    gather_ops.gather_compact(host, dev_b, *_swap(case))
    assert torch.equal(dev_a, dev_b)


@pytest.mark.parametrize("seed", range(8))
def test_gather_compact_group_matches_reference(seed: int, gather_ops) -> None:
    """One span read per token for G layers equals G reference gathers, bit for bit, and G
    of the backend's own per-layer gathers from the span's slices."""
    g = torch.Generator().manual_seed(300 + seed)
    bs = [1, 2, 4, 8][seed % 4]
    rb = [16, 48, 80, 656][seed % 4]
    G = [2, 3, 4, 1][seed % 4]
    case = make_resolve_case(
        Q=[1, 3, 5][seed % 3], K=8, H=24, block_size=bs, seed=seed, max_rows=2,
        hot_fill=[0.0, 0.5][seed % 2], reuse=[0.0, 0.7][seed % 2],
    )  # fmt: skip
    ref.resolve_residency(*case.args())
    # token-major: each token's G rows side by side
    span = random_paged_view(int(case.source_block_table.max()) + 1, bs, G * rb, G * rb, g)
    nd = int(case.hot_block_table.max()) + 1
    # One device pool, block-outermost, each layer's page at its own offset (+ padding).
    page = bs * rb
    block = G * page + 16 * (seed % 3)
    raw = torch.randint(0, 256, (nd * block + 16,), dtype=torch.uint8, generator=g)
    order = torch.randperm(G, generator=g).tolist()  # layer j's page is slot order[j]

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf.as_strided((nd, bs, rb), (block, rb, 1), 16 + o * page) for o in order]

    pool_a, pool_b, pool_c = raw.clone(), raw.clone(), raw.clone()
    ref.gather_compact_group(span, views(pool_a), *_swap(case))
    gather_ops.gather_compact_group(span, views(pool_b), *_swap(case))
    assert torch.equal(pool_a, pool_b)
    assert int(case.swap_count.sum()) == 0 or not torch.equal(pool_a, raw)
    for j, v in enumerate(views(pool_c)):
        gather_ops.gather_compact(span[:, :, j * rb : (j + 1) * rb], v, *_swap(case))
    assert torch.equal(pool_a, pool_c)
    with pytest.raises(ValueError, match="layers x"):
        gather_ops.gather_compact_group(span[:, :, :-16], views(pool_b), *_swap(case))


@pytest.mark.parametrize("seed", range(12))
def test_gather_plan_matches_reference(seed: int, gather_ops) -> None:
    g = torch.Generator().manual_seed(50 + seed)
    bs_s, bs_d, rb = 4, 2, 32
    n = 37 if seed < 6 else 1  # one entry: a batch-1 decode step's mirror
    src = random_paged_view(9, bs_s, rb, rb + 16, g)
    dst_a = random_paged_view(30, bs_d, rb, rb, g)
    if seed % 4 in (1, 2):  # dense arrays: rows read / written through one merged view
        src = src.contiguous()
    if seed % 4 in (2, 3):
        dst_a = dst_a.contiguous()
    dst_b = dst_a.clone()
    src_rows = torch.randint(0, 9 * bs_s, (n,), generator=g)
    dst_rows = torch.randperm(30 * bs_d, generator=g)[:n]
    mask = torch.rand(n, generator=g) < 0.6
    if seed % 2:
        src_rows, dst_rows, mask = src_rows.int(), dst_rows.int(), mask.int()
    if seed % 3 == 2:  # [n, 1] shapes, as the runtime passes 2-D plans
        src_rows, dst_rows, mask = src_rows[:, None], dst_rows[:, None], mask[:, None]
    before = dst_a.clone()
    ref.gather_plan(src, dst_a, src_rows, dst_rows, mask)
    gather_ops.gather_plan(src, dst_b, src_rows, dst_rows, mask)
    assert torch.equal(dst_a, dst_b)
    assert torch.equal(dst_a, before) != bool(mask.bool().any())  # rows moved iff any live


@pytest.mark.parametrize("seed", range(4))
def test_gather_plan_without_mask_copies_where_both_rows_are_valid(seed: int, gather_ops) -> None:
    """``mask=None`` (a step's host mirror): rows with a ``-1`` on either side stay put."""
    g = torch.Generator().manual_seed(90 + seed)
    src = random_paged_view(9, 4, 32, 48, g)
    dst = random_paged_view(30, 2, 32, 32, g)
    n = 1 if seed == 3 else 25
    src_rows = torch.randint(0, 36, (n,), generator=g)
    dst_rows = torch.randperm(60, generator=g)[:n]
    src_rows[torch.rand(n, generator=g) < 0.3] = -1
    dst_rows[torch.rand(n, generator=g) < 0.3] = -1
    if seed % 2:
        src_rows, dst_rows = src_rows.int(), dst_rows.int()
    explicit = (src_rows >= 0) & (dst_rows >= 0)
    a, b, c = dst.clone(), dst.clone(), dst.clone()
    ref.gather_plan(src, a, src_rows, dst_rows, explicit)
    ref.gather_plan(src, b, src_rows, dst_rows, None)
    gather_ops.gather_plan(src, c, src_rows, dst_rows, None)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(a, dst) != bool(explicit.any())


# --- invalidation ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", INVALIDATE)
@pytest.mark.parametrize("seed", range(8))
def test_invalidate_matches_reference(seed: int, backend: str, monkeypatch) -> None:
    ops = _backend(backend, monkeypatch)
    hot, state, row_req, written = make_invalidate_case(80 + seed)
    a, b = hot.clone(), hot.clone()
    ref.invalidate_written_slots(a, state, row_req, written)
    ops.invalidate_written_slots(b, state, row_req, written)
    assert torch.equal(a, b)
    assert not torch.equal(a, hot) or seed  # the first case changes something
