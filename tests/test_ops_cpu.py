"""The CPU backend (`CpuBackend`) equals the reference exactly: outputs, state and errors.

Same method as the Triton tests (tests/test_ops_triton.py): fresh random inputs from the shared
generators of `hisparse.testing.ops_cases`, outputs poisoned first, every output and state
tensor compared with ``torch.equal``; resolve cases run several steps on the evolving hot state.
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


@pytest.mark.parametrize("seed", range(60))
def test_resolve_random_multistep(seed: int, one_request_path: bool) -> None:
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
    )
    _run_both(case, steps=4, seed=seed)


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
def test_resolve_edges(kw: dict, one_request_path: bool) -> None:
    base = dict(Q=3, K=8, H=16, block_size=4, seed=7, max_rows=2)
    base.update(kw)
    _run_both(make_resolve_case(**base), steps=2, seed=7)


def test_resolve_wanted_fills_whole_hot_buffer(one_request_path: bool) -> None:
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
    _run_both(case, steps=1)


def test_resolve_strided_outputs_and_short_row_req() -> None:
    """Outputs as column slices of wider buffers (the runtime's ``physical[:rows, :k]``)."""
    case = make_resolve_case(Q=3, K=6, H=24, block_size=2, seed=21, max_rows=2)
    R = case.topk.shape[0]
    wide = torch.full((R + 3, 10), POISON, dtype=torch.int32)
    case.out_physical = wide[:, :6]
    _run_both(case, steps=3, seed=21)


def test_resolve_hand_example(one_request_path: bool) -> None:
    """The reference test's worked example."""
    H = 8
    hot_index = torch.full((1, H), -1, dtype=torch.int32)
    lru = torch.arange(H, dtype=torch.int16).repeat(1, 1)
    out = torch.full((1, 5), 12345, dtype=torch.int32)
    src = torch.full((1, H), -7, dtype=torch.int32)
    dst = src.clone()
    cnt = torch.full((1,), 99, dtype=torch.int32)
    cpu.resolve_residency(
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


@pytest.fixture(params=[True, False], ids=["reshape-view", "as-strided-view"])
def reshape_has_copy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Merge block and row dimensions with ``reshape(copy=False)`` and with `as_strided`."""
    if request.param and not numpy_ops._RESHAPE_HAS_COPY:
        pytest.skip("numpy < 2.1 has no reshape(copy=False)")
    monkeypatch.setattr(numpy_ops, "_RESHAPE_HAS_COPY", request.param)
    return request.param


@pytest.mark.parametrize("seed", range(9))
def test_gather_compact_matches_reference(seed: int, reshape_has_copy: bool) -> None:
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
    ref.gather_compact(host, dev_a, case.swap_src, case.swap_dst, case.swap_count)
    cpu.gather_compact(host, dev_b, case.swap_src, case.swap_dst, case.swap_count)
    assert torch.equal(dev_a, dev_b)
    assert int(case.swap_count.sum()) == 0 or not torch.equal(dev_a, before)
    # Negative counts list nothing.
    case.swap_count.fill_(-3)
    ref.gather_compact(host, dev_a, case.swap_src, case.swap_dst, case.swap_count)
    cpu.gather_compact(host, dev_b, case.swap_src, case.swap_dst, case.swap_count)
    assert torch.equal(dev_a, dev_b)


@pytest.mark.parametrize("seed", range(8))
def test_gather_compact_group_matches_reference(seed: int, reshape_has_copy: bool) -> None:
    g = torch.Generator().manual_seed(300 + seed)
    bs = [1, 2, 4, 8][seed % 4]
    rb = [16, 48, 80, 656][seed % 4]
    G = [2, 3, 4, 1][seed % 4]
    case = make_resolve_case(
        Q=[1, 3, 5][seed % 3], K=8, H=24, block_size=bs, seed=seed, max_rows=2,
        hot_fill=[0.0, 0.5][seed % 2], reuse=[0.0, 0.7][seed % 2],
    )  # fmt: skip
    ref.resolve_residency(*case.args())
    span = random_paged_view(int(case.source_block_table.max()) + 1, bs, G * rb, G * rb, g)
    nd = int(case.hot_block_table.max()) + 1
    page = bs * rb
    block = G * page + 16 * (seed % 3)
    raw = torch.randint(0, 256, (nd * block + 16,), dtype=torch.uint8, generator=g)
    order = torch.randperm(G, generator=g).tolist()

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf.as_strided((nd, bs, rb), (block, rb, 1), 16 + o * page) for o in order]

    pool_a, pool_b = raw.clone(), raw.clone()
    ref.gather_compact_group(span, views(pool_a), case.swap_src, case.swap_dst, case.swap_count)
    cpu.gather_compact_group(span, views(pool_b), case.swap_src, case.swap_dst, case.swap_count)
    assert torch.equal(pool_a, pool_b)
    assert int(case.swap_count.sum()) == 0 or not torch.equal(pool_a, raw)
    with pytest.raises(ValueError, match="layers x"):
        cpu.gather_compact_group(span[:, :, :-16], views(pool_b), *_swap(case))


def _swap(case: ResolveCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return case.swap_src, case.swap_dst, case.swap_count


@pytest.mark.parametrize("seed", range(12))
def test_gather_plan_matches_reference(seed: int, reshape_has_copy: bool) -> None:
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
    cpu.gather_plan(src, dst_b, src_rows, dst_rows, mask)
    assert torch.equal(dst_a, dst_b)
    assert torch.equal(dst_a, before) != bool(mask.bool().any())  # rows moved iff any live


@pytest.mark.parametrize("seed", range(4))
def test_gather_plan_without_mask_copies_where_both_rows_are_valid(seed: int) -> None:
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
    cpu.gather_plan(src, c, src_rows, dst_rows, None)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(a, dst) != bool(explicit.any())


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


@pytest.mark.parametrize("broadcast_max", [1 << 16, 0])  # compare all pairs / sorted keys
@pytest.mark.parametrize("seed", range(8))
def test_invalidate_matches_reference(
    seed: int, broadcast_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(numpy_ops, "_INVALIDATE_BROADCAST_MAX", broadcast_max)
    hot, state, row_req, written = make_invalidate_case(80 + seed)
    a, b = hot.clone(), hot.clone()
    ref.invalidate_written_slots(a, state, row_req, written)
    cpu.invalidate_written_slots(b, state, row_req, written)
    assert torch.equal(a, b)
    assert not torch.equal(a, hot) or seed  # the first case changes something


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
