"""The Triton data-plane ops equal the reference exactly (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` must be set before the kernels are defined, so this module sets it
before importing them (it only affects Triton kernels run on CPU tensors). Every case draws
fresh random inputs, poisons the outputs, and compares every output and state tensor with
``torch.equal``; resolve cases run several steps on the evolving hot state. What every backend
must do runs on this one and the CPU backend in tests/test_ops_backends.py; here, what only
the Triton kernels have: each resolve kernel and its knobs, host rows near 2^31, the split
threshold, the grouped gather's tiles and checks, the mirrored invalidation, the all-GPU
lookups and row scatters, lazy import.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from hisparse.runtime.ops import reference as ref
from hisparse.runtime.ops import triton_backend as tk
from hisparse.runtime.ops import triton_resolve as tr
from hisparse.runtime.ops.triton_common import interpreting
from hisparse.testing.ops_cases import (
    POISON,
    compare,
    make_resolve_case,
    random_paged_view,
    shift_host_rows,
)
from test_ops_backends import run_both

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


def _run_both(case, steps: int = 1, seed: int = 0) -> None:
    """Reference and Triton resolve over ``steps`` steps; the Triton one also adds its hits,
    misses and rows moved to running totals (``totals=``), checked against the reference's
    per-request counters summed (`test_ops_backends.run_both`)."""
    run_both(tk, case, steps=steps, seed=seed)


@pytest.mark.parametrize(
    ("impl", "log_buckets", "bh", "rank_tile", "window"),
    [
        ("bucket", 0, 8, 2, 0),  # one bucket: almost every row overflows; H in 4 chunks
        ("bucket", 1, 16, 4, 0),
        ("bucket", 2, 4096, 2, 0),
        ("bucket", None, 4096, 128, 0),
        ("bucket", None, 4096, 4, 4),  # up to 4 misses: a window sort; else rank tiles
        ("split", None, 4096, 4, 0),  # several programs per request, five launches
        ("split", 0, 8, 2, 0),  # one bucket: overflow cells claimed across programs
        ("split", 1, 16, 4, 0),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_resolve_each_kernel(
    impl: str,
    log_buckets: int | None,
    bh: int,
    rank_tile: int,
    window: int,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overflowing buckets, hot-slot chunks, swap-rank tiles and the swap-list window sort."""
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_MAX_Q", 0)  # "bucket": one program, any batch
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_PROGRAMS", 4)  # "split": 2-4 entries per program
    monkeypatch.setattr(tr, "RESOLVE_IMPL", impl)
    monkeypatch.setattr(tr, "RESOLVE_LOG_BUCKETS", log_buckets)
    monkeypatch.setattr(tr, "RESOLVE_BH", bh)
    monkeypatch.setattr(tr, "RESOLVE_RANK_TILE", rank_tile)
    monkeypatch.setattr(tr, "RESOLVE_SORT_WINDOW", window)
    case = make_resolve_case(
        Q=3, K=8, H=32, block_size=4, seed=50 + seed, max_rows=2, p_dup=0.2, hot_fill=0.7,
        reuse=0.5 if seed % 2 else 0.0,
    )  # fmt: skip
    _run_both(case, steps=3, seed=seed)


@pytest.mark.parametrize(("impl", "window"), [("bucket", 0), ("bucket", 4), ("split", 0)])
def test_resolve_host_rows_just_below_2_31(
    impl: str, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rows up to 2^31 - 1 (a 1 TiB host pool of 656-byte rows holds 1.7e9): hashing,
    swap-list order (window sort and rank tiles) and the int32 lists all keep them exact."""
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_MAX_Q", 0)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_PROGRAMS", 4)
    monkeypatch.setattr(tr, "RESOLVE_IMPL", impl)
    monkeypatch.setattr(tr, "RESOLVE_SORT_WINDOW", window)
    case = make_resolve_case(
        Q=3, K=8, H=32, block_size=4, seed=90, max_rows=2, p_dup=0.2, hot_fill=0.7, reuse=0.5
    )
    top = int(case.source_block_table.max() + 1) * 4  # rows past the case's highest one
    case = shift_host_rows(case, (2**31 - top) // 4 * 4)
    assert int(case.source_block_table.max() + 1) * 4 > 2**31 - 8
    _run_both(case, steps=3, seed=90)


@pytest.mark.parametrize("window", [300, -4])
def test_resolve_sort_window_must_be_a_power_of_two(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tr, "RESOLVE_SORT_WINDOW", window)
    case = make_resolve_case(Q=2, K=4, H=16, block_size=2, seed=3, max_rows=1)
    before = case.clone()
    with pytest.raises(ValueError, match="power of two"):
        tk.resolve_residency(*case.args())
    assert not compare(before.state_and_outputs(), case.state_and_outputs())  # nothing touched


@pytest.mark.parametrize("programs", [0, 1, 2, 16])
def test_resolve_split_below_the_batch_threshold(
    programs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches up to RESOLVE_SPLIT_MAX_Q take the split kernels (any program count), larger
    ones, resident-only calls (hot buffer below top_k) and requests of fewer entries than
    RESOLVE_SPLIT_MIN_ENTRIES the one-program kernel."""
    calls: list[int] = []
    split = tr.resolve_split

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[2])  # Q
        return split(*args, **kwargs)

    monkeypatch.setattr(tr, "resolve_split", counting)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_MAX_Q", 3)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_MIN_ENTRIES", 8)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_PROGRAMS", programs)
    for Q, H, K in ((3, 16, 8), (4, 16, 8), (2, 4, 8), (3, 4, 2)):
        case = make_resolve_case(Q=Q, K=K, H=H, block_size=2, seed=20 + Q, max_rows=1)
        _run_both(case, steps=2, seed=Q)
    assert calls == [3, 3]  # two steps of the first case only


@pytest.mark.parametrize("impl", ["bucket", "split"])
def test_resolve_more_rows_than_slots_keeps_a_valid_state(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 distinct rows wanted, 8 slots, 4 of them hits (configuration checks prevent this;
    the reference raises): the first misses by rank get the 4 free slots, the others read -1;
    the LRU stays a permutation and nothing outside the slots is written."""
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_MAX_Q", 0)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_PROGRAMS", 2)
    monkeypatch.setattr(tr, "RESOLVE_IMPL", impl)
    H, K = 8, 8
    src_bt = torch.arange(1, 33, dtype=torch.int32).view(1, 32)  # position p: host row p + 1
    hot_index = torch.tensor([[1, 2, 3, 4, -1, -1, -1, -1]], dtype=torch.int32)
    lru = torch.arange(H, dtype=torch.int16).view(1, H)
    hot_bt = torch.arange(100, 108, dtype=torch.int32).view(1, H)  # slot h: physical row 100 + h
    topk = torch.arange(16, dtype=torch.int32).view(2, K)
    out = torch.full((2, K), POISON, dtype=torch.int32)
    src = torch.full((1, H), POISON, dtype=torch.int32)
    dst = src.clone()
    count = torch.full((1,), POISON, dtype=torch.int32)
    hm = torch.full((1, 2), POISON, dtype=torch.int32)
    tk.resolve_residency(
        topk, torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
        src_bt, None, hot_bt, hot_index, lru, 1, out, src, dst, count, None, hm,
        max_rows_per_request=2,
    )  # fmt: skip
    assert hm.tolist() == [[4, 12]] and count.tolist() == [4]
    assert out[0, :4].tolist() == [100, 101, 102, 103]  # the hits keep their slots
    assert out[0, 4:].tolist() == [104, 105, 106, 107]  # the first 4 misses take the free slots
    assert out[1].tolist() == [-1] * K  # no slot left: never a stale or made-up row
    assert hot_index.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert sorted(lru[0].tolist()) == list(range(H))
    assert src.tolist()[0][:4] == [5, 6, 7, 8] and dst.tolist()[0][:4] == [104, 105, 106, 107]


@pytest.mark.parametrize(
    ("knob", "value", "match"),
    [("RESOLVE_IMPL", "sort", "bucket or split"), ("RESOLVE_SPLIT_PROGRAMS", 6, "power")],
)
def test_resolve_bad_knob_is_refused(
    knob: str, value: object, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tr, knob, value)
    case = make_resolve_case(Q=2, K=4, H=16, block_size=2, seed=3, max_rows=1)
    before = case.clone()
    with pytest.raises(ValueError, match=match):
        tk.resolve_residency(*case.args())
    assert not compare(before.state_and_outputs(), case.state_and_outputs())  # nothing touched


def test_resolve_max_rows_per_request_keyword() -> None:
    case = make_resolve_case(Q=3, K=4, H=16, block_size=2, seed=11, max_rows=1)
    a, b = case.clone(), case.clone()
    ref.resolve_residency(*a.args())
    tk.resolve_residency(*b.args(), max_rows_per_request=1)
    assert not compare(a.state_and_outputs(), b.state_and_outputs())


_paged = random_paged_view  # a random paged uint8 view whose rows may sit apart


@pytest.mark.parametrize("tile", [(64, 1), (256, 2)])
def test_gather_compact_group_tile_override(tile: tuple[int, int]) -> None:
    """Other lane counts per step (several entries per step, a tail) give the same bytes."""
    g = torch.Generator().manual_seed(9)
    bs, rb, G = 2, 48, 3
    case = make_resolve_case(Q=3, K=8, H=24, block_size=bs, seed=4, max_rows=2, hot_fill=0.0)
    ref.resolve_residency(*case.args())
    span = _paged(int(case.source_block_table.max()) + 1, bs, G * rb, G * rb, g)
    nd = int(case.hot_block_table.max()) + 1
    pool = torch.randint(0, 256, (nd, G, bs, rb), dtype=torch.uint8, generator=g)
    a, b = pool.clone(), pool.clone()
    ref.gather_compact_group(span, [a[:, j] for j in range(G)], *_swap(case))
    tk.gather_compact_group(span, [b[:, j] for j in range(G)], *_swap(case), tile=tile)
    assert torch.equal(a, b) and not torch.equal(a, pool)


def _swap(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return case.swap_src, case.swap_dst, case.swap_count


def test_gather_compact_group_rejects_bad_views() -> None:
    span = torch.zeros(2, 2, 64, dtype=torch.uint8)
    z = torch.zeros(1, 1, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    pool = torch.zeros(4, 2, 2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="share one storage"):
        tk.gather_compact_group(span, [pool[:, 0], pool.clone()[:, 1]], z, z, one)
    with pytest.raises(ValueError, match="equal shapes and strides"):
        tk.gather_compact_group(span, [pool[:, 0], pool[:3, 1]], z, z, one)
    with pytest.raises(ValueError, match="layers x"):
        tk.gather_compact_group(span, [pool[:, 0]], z, z, one)


@pytest.mark.parametrize("seed", range(4))
def test_invalidate_with_mirror_matches_reference(seed: int) -> None:
    """``mirror=``: the written rows copied to the host in the same launch, as the reference's
    `gather_plan` then `invalidate_written_slots` do (random rows, some ``-1`` on either side,
    padding requests, a state slot of ``-1``, the host poisoned first)."""
    g = torch.Generator().manual_seed(90 + seed)
    S, H, Q, n, bs_s, bs_d, rb = 4, 40, 3, 9, 4, 2, 48
    hot = torch.full((S, H), -1, dtype=torch.int32)
    for s in range(S):
        k = int(torch.randint(1, H, (1,), generator=g))
        hot[s, torch.randperm(H, generator=g)[:k]] = torch.randperm(60, generator=g)[:k].int()
    state = torch.randperm(S, generator=g)[:Q].int()
    if seed % 2:
        state[int(torch.randint(0, Q, (1,), generator=g))] = -1
    row_req = torch.randint(-1, Q, (n,), generator=g).int()
    written = torch.randperm(60, generator=g)[:n].int()
    written[torch.rand(n, generator=g) < 0.2] = -1
    dev_rows = torch.randint(0, 9 * bs_s, (n,), generator=g).int()
    dev_rows[torch.rand(n, generator=g) < 0.2] = -1
    src = _paged(9, bs_s, rb, rb, g)
    host_a = _paged(30, bs_d, rb, rb + 16, g)
    host_a.fill_(0xA5)
    host_b = host_a.clone()
    a, b = hot.clone(), hot.clone()
    ref.gather_plan(src, host_a, dev_rows, written, None)
    ref.invalidate_written_slots(a, state, row_req, written)
    tk.invalidate_written_slots(b, state, row_req, written, mirror=(src, host_b, dev_rows))
    assert torch.equal(a, b)
    assert torch.equal(host_a, host_b)
    assert not torch.equal(a, hot) or seed  # the first case changes something


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows,k", [(1, 2048), (29, 2048), (7, 300), (40, 16)])
def test_resident_rows_matches_reference(seed: int, rows: int, k: int) -> None:
    """All-GPU lookups: random tables with some pages not resident, padding rows, ``-1``
    entries and strided top-k; outputs poisoned (past the rows too)."""
    g = torch.Generator().manual_seed(seed * 1000 + rows)
    bs, nb, q = 64, 40, max(2, rows // 3)
    table = torch.randint(1, 500, (q + 1, nb), generator=g, dtype=torch.int32)
    table[torch.rand(q + 1, nb, generator=g) < 0.1] = 0  # not resident
    topk = torch.randint(-1, nb * bs, (rows, k + 5), generator=g, dtype=torch.int32)[:, :k]
    req = torch.randint(0, q, (rows,), generator=g, dtype=torch.int32)
    req[1::4] = -1  # padding rows
    outs = []
    for fn in (ref.resident_rows, tk.resident_rows):
        phys = torch.full((rows + 3, k), POISON, dtype=torch.int32)
        valid = torch.full((rows + 3,), POISON, dtype=torch.int32)
        fn(topk, req, table, bs, phys, valid)
        outs.append((phys, valid))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert (outs[1][0][rows:] == POISON).all()  # rows past R untouched
    assert (outs[1][0][:rows] >= 0).any() and (outs[1][0][:rows] == -1).any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n,row_bytes", [(1, 768), (64, 768), (29, 192), (300, 32)])
def test_scatter_rows_matches_reference(seed: int, n: int, row_bytes: int) -> None:
    """A step's new rows into strided pages (the pool's layout: other layers between blocks),
    skipped slots included; the whole pool compared (untouched bytes stay)."""
    g = torch.Generator().manual_seed(seed * 100 + n)
    nb, bs = 40, 16
    pool = torch.randint(0, 256, (nb, bs * row_bytes + 64), generator=g, dtype=torch.uint8)
    values = torch.randint(0, 256, (n, row_bytes), generator=g, dtype=torch.uint8)
    slots = bs + torch.randperm((nb - 1) * bs, generator=g)[:n]
    slots[1::5] = -1
    out = []
    for fn in (ref.scatter_rows, tk.scatter_rows):
        p = pool.clone()
        fn(values, p[:, : bs * row_bytes].unflatten(1, (bs, row_bytes)), slots)
        out.append(p)
    assert torch.equal(out[0], out[1]) and not torch.equal(out[1], pool)


def test_gather_rejects_unaligned_rows() -> None:
    v = torch.zeros(2, 2, 24, dtype=torch.uint8)
    z = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="16"):
        tk.gather_compact(v, v, z, z, torch.ones(1, dtype=torch.int32))


def test_package_import_does_not_import_triton_and_cuda_dispatch_is_lazy() -> None:
    code = (
        "import sys, hisparse.runtime.ops as ops\n"
        "assert 'triton' not in sys.modules, 'triton imported at package import'\n"
        "assert ops.ops_for('cpu') is ops.cpu_backend()\n"
        "m = ops.ops_for('cuda')\n"
        "assert m.__name__.endswith('triton_backend'), m\n"
        "assert ops.ops_for('cpu') is ops.cpu_backend()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HISPARSE_OPS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
