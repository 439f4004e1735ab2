"""Triton data-plane ops on CUDA at real sizes equal the reference exactly; graph replay works.

Runs on the GPU machine only (``pytest tests/gpu``; CI ignores this folder). The host side of
every gather is a pinned CPU tensor read zero-copy by the kernel. ``-k large``: host rows
near 2^31 and gathers from rows past byte 2^32 of a pinned 5 GiB buffer.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from hisparse.runtime.ops import ops_for
from hisparse.runtime.ops import reference as ref
from hisparse.runtime.ops import triton_resolve as tr
from hisparse.testing.ops_cases import (
    POISON,
    compare,
    make_resolve_case,
    next_step_topk,
    shift_host_rows,
)

DEV = torch.device("cuda")
tk = ops_for(DEV)


def test_cuda_dispatch_is_triton() -> None:
    assert tk.__name__.endswith("triton_backend")


def _steps(case, steps: int, seed: int, **kw) -> None:
    a, b = case.to(DEV), case.to(DEV)
    for step in range(steps):
        if step:
            topk = next_step_topk(a, seed * 100 + step)
            for c in (a, b):
                c.topk = topk.clone()
                for t in (c.out_physical, c.swap_src, c.swap_dst, c.swap_count):
                    t.fill_(POISON - step)
        ref.resolve_residency(*a.args())
        tk.resolve_residency(*b.args(), **kw)
        torch.cuda.synchronize()
        bad = compare(a.state_and_outputs(), b.state_and_outputs())
        assert not bad, f"step {step}: {bad} differ"


@pytest.mark.parametrize(
    "Q,H,max_rows,seed",
    [(64, 4096, 1, 0), (64, 8192, 2, 1), (128, 4096, 2, 2), (256, 8192, 1, 3), (16, 8192, 4, 4)],
)
def test_resolve_real_sizes(Q: int, H: int, max_rows: int, seed: int) -> None:
    case = make_resolve_case(
        Q=Q, K=2048, H=H, block_size=64, seed=seed, max_rows=max_rows, p_neg=0.02,
        p_dup=0.02, p_resident_page=0.05, reuse=0.95, hot_fill=0.9, extra_out_rows=1,
    )  # fmt: skip
    _steps(case, steps=3, seed=seed)


def test_resolve_decode_bound_keyword() -> None:
    case = make_resolve_case(Q=64, K=2048, H=8192, block_size=64, seed=9, max_rows=1)
    _steps(case, steps=2, seed=9, max_rows_per_request=1)


@pytest.mark.parametrize(
    "Q,H,max_rows", [(1, 4096, 1), (1, 8292, 4), (8, 8192, 4), (64, 4096, 2), (3, 2148, 1)]
)
@pytest.mark.parametrize("log_buckets", [0, None])  # 0: one bucket, nearly all rows overflow
@pytest.mark.parametrize("programs", [0, 4, 64])  # by batch, fewer, more than some H / P
def test_resolve_split_kernels(
    Q: int, H: int, max_rows: int, log_buckets: int | None, programs: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The split resolve (several programs per request) on real sizes: cells claimed by
    concurrent programs, hot buffers not a multiple of the program count, 30% duplicates."""
    monkeypatch.setattr(tr, "RESOLVE_IMPL", "split")
    monkeypatch.setattr(tr, "RESOLVE_LOG_BUCKETS", log_buckets)
    monkeypatch.setattr(tr, "RESOLVE_SPLIT_PROGRAMS", programs)
    seed = Q * 7 + H + programs
    case = make_resolve_case(
        Q=Q, K=2048, H=H, block_size=64, seed=seed, max_rows=max_rows, p_dup=0.3, p_neg=0.05,
        reuse=0.5, hot_fill=0.9, p_pad_req=0.2, p_pad_row=0.1, extra_out_rows=1,
        extra_req_rows=1,
    )  # fmt: skip
    _steps(case, steps=3, seed=seed, max_rows_per_request=max_rows)


def test_resolve_small_random_many() -> None:
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        K = [3, 8, 64, 100][seed % 4]
        H = [128, 256, 300][seed % 3]
        case = make_resolve_case(
            Q=int(torch.randint(1, 9, (1,), generator=g)), K=K, H=H,
            block_size=[1, 4, 16][seed % 3], seed=seed, max_rows=max(1, min(3, H // K)),
            p_neg=0.1, p_dup=0.2, p_resident_page=0.2, p_pad_req=0.2, p_pad_row=0.1,
            hot_fill=[0.0, 0.6, 1.0][seed % 3], reuse=[0.3, 0.8, 1.0][seed % 3],
            with_resident=seed % 5 != 0, with_optional=seed % 7 != 0,
            index_dtype=[torch.int32, torch.int64][seed % 2],
        )  # fmt: skip
        _steps(case, steps=2, seed=seed)


def _host_paged(num_blocks: int, bs: int, row_bytes: int, row_stride: int) -> torch.Tensor:
    """A pinned host paged view filled with random bytes."""
    block_stride = bs * row_stride
    raw = torch.empty(num_blocks * block_stride, dtype=torch.uint8).pin_memory()
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=DEV).cpu())
    return raw.as_strided((num_blocks, bs, row_bytes), (block_stride, row_stride, 1))


@pytest.mark.parametrize("row_bytes,row_stride", [(656, 656), (1152, 1152), (768, 768 * 3)])
def test_gather_compact_pinned_host_real_sizes(row_bytes: int, row_stride: int) -> None:
    case = make_resolve_case(Q=64, K=2048, H=4096, block_size=64, seed=5, reuse=0.9).to(DEV)
    ref.resolve_residency(*case.args())
    host = _host_paged(int(case.source_block_table.max()) + 1, 64, row_bytes, row_stride)
    nb = int(case.hot_block_table.max()) + 1
    dev_a = torch.randint(0, 256, (nb, 64, row_bytes), dtype=torch.uint8, device=DEV)
    dev_b = dev_a.clone()
    ref.gather_compact(host, dev_a, case.swap_src, case.swap_dst, case.swap_count)
    tk.gather_compact(host, dev_b, case.swap_src, case.swap_dst, case.swap_count)
    torch.cuda.synchronize()
    assert int(case.swap_count.sum()) > 1000
    assert torch.equal(dev_a, dev_b)


def test_gather_plan_host_and_device_sources() -> None:
    g = torch.Generator().manual_seed(3)
    host = _host_paged(200, 64, 656, 656)
    dev_src = torch.randint(0, 256, (50, 64, 656), dtype=torch.uint8, device=DEV)
    for src, with_mask in ((host, True), (dev_src, True), (host, False)):
        n = 5000
        src_rows = torch.randint(0, src.shape[0] * 64, (n,), generator=g)
        dst_rows = torch.randperm(300 * 64, generator=g)[:n]
        mask = (torch.rand(n, generator=g) < 0.7).to(DEV)
        if not with_mask:  # the host mirror's form: copy where both rows are valid
            src_rows[torch.rand(n, generator=g) < 0.2] = -1
            dst_rows[torch.rand(n, generator=g) < 0.2] = -1
            mask = None
        src_rows, dst_rows = src_rows.to(DEV), dst_rows.to(DEV)
        dst_a = torch.randint(0, 256, (300, 64, 656), dtype=torch.uint8, device=DEV)
        dst_b = dst_a.clone()
        ref.gather_plan(src, dst_a, src_rows, dst_rows, mask)
        tk.gather_plan(src, dst_b, src_rows, dst_rows, mask)
        torch.cuda.synchronize()
        assert torch.equal(dst_a, dst_b)


def test_invalidate_real_sizes() -> None:
    case = make_resolve_case(Q=64, K=2048, H=4096, block_size=64, seed=8).to(DEV)
    g = torch.Generator().manual_seed(8)
    n = 512
    row_req = torch.randint(-1, 64, (n,), generator=g).int().to(DEV)
    slot = case.request_state_indices.clamp_min(0).long()[row_req.clamp_min(0).long()]
    held = case.hot_index[slot]
    pick = held[torch.arange(n, device=DEV), torch.randint(0, 4096, (n,), device=DEV)]
    written = torch.where(torch.rand(n, device=DEV) < 0.8, pick, 123).int()
    a, b = case.hot_index.clone(), case.hot_index.clone()
    ref.invalidate_written_slots(a, case.request_state_indices, row_req, written)
    tk.invalidate_written_slots(b, case.request_state_indices, row_req, written)
    torch.cuda.synchronize()
    assert not torch.equal(a, case.hot_index)
    assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 29, 512])
def test_invalidate_with_the_host_mirror_real_sizes(n: int) -> None:
    """``mirror=``: a decode step's new rows (656 B, device pages) into a pinned host pool
    and out of the hot slots in one launch, as the reference's `gather_plan` then
    `invalidate_written_slots` do (host poisoned first; padding rows; most written rows are
    held by their request's slots, each row written once, as a step writes them)."""
    case = make_resolve_case(Q=64, K=256, H=512, block_size=64, seed=9).to(DEV)
    g = torch.Generator().manual_seed(9 + n)
    row_req = torch.randint(-1, 64, (n,), generator=g).int()
    slot = case.request_state_indices.cpu().clamp_min(0).long()[row_req.clamp_min(0).long()]
    held = case.hot_index.cpu()[slot]
    pick = held[torch.arange(n), torch.randint(0, 512, (n,), generator=g)].tolist()
    seen: set[int] = set()
    written = []
    for i, r in enumerate(pick):  # distinct rows; a fresh one where taken or empty
        r = r if r >= 0 and r not in seen and torch.rand(1, generator=g) < 0.8 else 150_000 + i
        seen.add(r)
        written.append(r)
    written_t = torch.tensor(written, dtype=torch.int32, device=DEV)
    dev_rows = torch.randperm(50 * 64, generator=g)[:n].int()
    dev_rows[torch.rand(n, generator=g) < 0.1] = -1
    src = torch.randint(0, 256, (50, 64, 656), dtype=torch.uint8, device=DEV)
    blocks = max(written) // 64 + 2
    host_a = _host_paged(blocks, 64, 656, 656)
    host_a.fill_(0x5A)
    host_b = _host_paged(blocks, 64, 656, 656)
    host_b.copy_(host_a)
    row_req, dev_rows = row_req.to(DEV), dev_rows.to(DEV)
    a, b = case.hot_index.clone(), case.hot_index.clone()
    ref.gather_plan(src, host_a, dev_rows, written_t, None)
    ref.invalidate_written_slots(a, case.request_state_indices, row_req, written_t)
    tk.invalidate_written_slots(
        b, case.request_state_indices, row_req, written_t, mirror=(src, host_b, dev_rows)
    )
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    assert torch.equal(host_a, host_b)
    assert bool((host_a != 0x5A).any()) or not bool((dev_rows >= 0).any())  # rows moved
    assert not torch.equal(a, case.hot_index) or n == 1  # and slots were emptied


def test_resolve_and_gather_in_cuda_graph_equal_eager() -> None:
    """Capture resolve + gather once; replays with new top-k equal eager calls."""
    Q, K, H, bs, rb = 64, 2048, 4096, 64, 656
    case = make_resolve_case(Q=Q, K=K, H=H, block_size=bs, seed=21, reuse=0.95).to(DEV)
    host = _host_paged(int(case.source_block_table.max()) + 1, bs, rb, rb)
    nb = int(case.hot_block_table.max()) + 1
    dev = torch.randint(0, 256, (nb, bs, rb), dtype=torch.uint8, device=DEV)
    g_case = case.clone()  # the graph's static tensors
    g_dev = dev.clone()
    e_case, e_dev = case.clone(), dev.clone()

    def step(c, d) -> None:
        tk.resolve_residency(*c.args())
        tk.gather_compact(host, d, c.swap_src, c.swap_dst, c.swap_count)

    # Warm up (compiles) on copies, on a side stream, then capture.
    w_case, w_dev = case.clone(), dev.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(w_case, w_dev)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(g_case, g_dev)
    # Capture does not run the kernels: the static state is still the initial one.
    assert torch.equal(g_case.hot_index, case.hot_index)
    for it in range(4):
        topk = next_step_topk(e_case, 500 + it, reuse=0.9)
        e_case.topk.copy_(topk)
        g_case.topk.copy_(topk)
        for t in (g_case.out_physical, g_case.swap_src, g_case.swap_dst):
            t.fill_(POISON)
        for t in (e_case.out_physical, e_case.swap_src, e_case.swap_dst):
            t.fill_(POISON)
        graph.replay()
        step(e_case, e_dev)
        torch.cuda.synchronize()
        bad = compare(e_case.state_and_outputs(), g_case.state_and_outputs())
        assert not bad, f"replay {it}: {bad} differ"
        assert torch.equal(e_dev, g_dev)
        assert int(e_case.swap_count.sum()) > 0


def _group_inputs(G: int, rb: int, seed: int, resolve: bool = True):
    """A real-size resolve, a pinned token-major host span and one device pool of G layers."""
    case = make_resolve_case(
        Q=64, K=2048, H=4096, block_size=64, seed=seed, reuse=0.9, hot_fill=0.9
    ).to(DEV)
    if resolve:
        ref.resolve_residency(*case.args())
    span = _host_paged(int(case.source_block_table.max()) + 1, 64, G * rb, G * rb)
    nb = int(case.hot_block_table.max()) + 1
    # Block-outermost pool: each layer's page at its own in-block offset (layers reversed).
    pool = torch.randint(0, 256, (nb, G, 64, rb), dtype=torch.uint8, device=DEV)
    return case, span, pool, [G - 1 - j for j in range(G)]


@pytest.mark.parametrize("G,rb", [(4, 656), (2, 656), (3, 1152), (1, 656)])
def test_gather_compact_group_pinned_host_real_sizes(G: int, rb: int) -> None:
    case, span, pool, order = _group_inputs(G, rb, seed=31 + G)
    a, b = pool.clone(), pool.clone()
    swap = (case.swap_src, case.swap_dst, case.swap_count)
    ref.gather_compact_group(span, [a[:, o] for o in order], *swap)
    tk.gather_compact_group(span, [b[:, o] for o in order], *swap)
    torch.cuda.synchronize()
    assert int(case.swap_count.sum()) > 1000
    assert torch.equal(a, b) and not torch.equal(a, pool)


def test_gather_compact_group_in_cuda_graph_equal_eager() -> None:
    """Capture resolve + group gather; replays with new top-k equal eager calls."""
    G, rb = 4, 656
    case, span, pool, order = _group_inputs(G, rb, seed=41, resolve=False)
    g_case, e_case, w_case = case.clone(), case.clone(), case.clone()
    g_pool, e_pool, w_pool = pool.clone(), pool.clone(), pool.clone()

    def step(c, p) -> None:
        tk.resolve_residency(*c.args())
        tk.gather_compact_group(
            span, [p[:, o] for o in order], c.swap_src, c.swap_dst, c.swap_count
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(w_case, w_pool)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(g_case, g_pool)
    for it in range(3):
        topk = next_step_topk(e_case, 700 + it, reuse=0.9)
        e_case.topk.copy_(topk)
        g_case.topk.copy_(topk)
        graph.replay()
        step(e_case, e_pool)
        torch.cuda.synchronize()
        assert not compare(e_case.state_and_outputs(), g_case.state_and_outputs())
        assert torch.equal(e_pool, g_pool)
        assert int(e_case.swap_count.sum()) > 0


@pytest.mark.parametrize(
    ("impl", "Q", "H", "max_rows"), [("bucket", 64, 4096, 1), ("split", 8, 8192, 4)]
)
def test_large_host_rows_resolve_near_2_31(
    impl: str, Q: int, H: int, max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rows just below 2^31 (a 1 TiB host pool of 656-byte rows holds 1.7e9) at real
    sizes: the int32 host rows, their hash and the swap-list order stay exact."""
    monkeypatch.setattr(tr, "RESOLVE_IMPL", impl)
    case = make_resolve_case(
        Q=Q, K=2048, H=H, block_size=64, seed=61 + Q, max_rows=max_rows, p_dup=0.05,
        reuse=0.9, hot_fill=0.9,
    )  # fmt: skip
    top = (int(case.source_block_table.max()) + 1) * 64
    case = shift_host_rows(case, (2**31 - top) // 64 * 64)
    assert (int(case.source_block_table.max()) + 1) * 64 > 2**31 - 64
    _steps(case, steps=3, seed=61 + Q, max_rows_per_request=max_rows)


#: Bytes of the pinned host buffer the large gathers read from: rows past byte `HIGH_BYTE`.
LARGE_HOST_BYTES, HIGH_BYTE = 5 << 30, 2**32


@pytest.fixture(scope="module")
def large_host() -> torch.Tensor:
    """A pinned uint8 buffer of `LARGE_HOST_BYTES` (contents arbitrary: each test writes
    random bytes into the rows it reads, so a read at a wrong offset shows)."""
    return torch.empty(LARGE_HOST_BYTES, dtype=torch.uint8, pin_memory=True)


def _high_rows(n: int, num_rows: int, row_bytes: int, g: torch.Generator) -> torch.Tensor:
    """``n`` host rows of ``num_rows``: 1/64 below byte `HIGH_BYTE`, the rest above it, the
    last row among them, shuffled (int64, CPU)."""
    above = HIGH_BYTE // row_bytes + 1
    assert num_rows > above
    low = torch.randint(0, above, (n // 64,), generator=g)
    high = torch.randint(above, num_rows, (n - n // 64 - 1,), generator=g)
    rows = torch.cat([low, high, torch.tensor([num_rows - 1])])
    return rows[torch.randperm(n, generator=g)]


def _fill_rows(view: torch.Tensor, rows: torch.Tensor, g: torch.Generator) -> None:
    """Random bytes into rows ``rows`` of a ``[blocks, block_size, row_bytes]`` host view."""
    flat = view.reshape(-1, view.shape[2])
    assert flat.data_ptr() == view.data_ptr()  # a view, not a copy
    flat[rows] = torch.randint(0, 256, (rows.numel(), view.shape[2]), dtype=torch.uint8,
                               generator=g)  # fmt: skip


def _host_view(buf: torch.Tensor, row_bytes: int, bs: int = 64) -> torch.Tensor:
    block = bs * row_bytes
    return buf[: buf.numel() // block * block].view(-1, bs, row_bytes)


def test_large_host_offsets_gather_compact(large_host: torch.Tensor) -> None:
    """Rows past byte 2^32 of a pinned 5 GiB host buffer (int64 byte offsets in the kernel)
    land where the reference puts them; counts of 0, 1, partial and full lists."""
    rb, bs, Q, H = 656, 64, 8, 2048
    g = torch.Generator().manual_seed(101)
    host = _host_view(large_host, rb)
    src = _high_rows(Q * H, host.shape[0] * bs, rb, g)
    _fill_rows(host, src, g)
    nbd = Q * H // bs + 8
    dst = torch.randperm(nbd * bs, generator=g)[: Q * H]
    count = torch.tensor([H, H - 5, 0, 1, H, 1000, 17, H], dtype=torch.int32)
    swap = (src.view(Q, H).int().to(DEV), dst.view(Q, H).int().to(DEV), count.to(DEV))
    dev_a = torch.randint(0, 256, (nbd, bs, rb), dtype=torch.uint8, device=DEV)
    dev_b, before = dev_a.clone(), dev_a.clone()
    ref.gather_compact(host, dev_a, *swap)
    tk.gather_compact(host, dev_b, *swap)
    torch.cuda.synchronize()
    assert torch.equal(dev_a, dev_b) and not torch.equal(dev_a, before)


def test_large_host_offsets_gather_plan(large_host: torch.Tensor) -> None:
    """`gather_plan` from the pinned buffer's rows past byte 2^32, with and without a mask."""
    rb, bs, n = 656, 64, 20000
    g = torch.Generator().manual_seed(102)
    host = _host_view(large_host, rb)
    src_rows = _high_rows(n, host.shape[0] * bs, rb, g)
    _fill_rows(host, src_rows, g)
    for with_mask in (True, False):
        dst_rows = torch.randperm(400 * bs, generator=g)[:n]
        mask = (torch.rand(n, generator=g) < 0.7).to(DEV) if with_mask else None
        s_rows = src_rows.clone()
        if not with_mask:
            s_rows[torch.rand(n, generator=g) < 0.2] = -1
        dst_a = torch.randint(0, 256, (400, bs, rb), dtype=torch.uint8, device=DEV)
        dst_b, before = dst_a.clone(), dst_a.clone()
        args = (s_rows.to(DEV), dst_rows.to(DEV), mask)
        ref.gather_plan(host, dst_a, *args)
        tk.gather_plan(host, dst_b, *args)
        torch.cuda.synchronize()
        assert torch.equal(dst_a, dst_b) and not torch.equal(dst_a, before)


def test_large_host_offsets_gather_compact_group(large_host: torch.Tensor) -> None:
    """One span read per token for 4 layers from the pinned buffer's spans past byte 2^32."""
    G, rb, bs, Q, H = 4, 656, 64, 8, 2048
    g = torch.Generator().manual_seed(103)
    span = _host_view(large_host, G * rb)
    src = _high_rows(Q * H, span.shape[0] * bs, G * rb, g)
    _fill_rows(span, src, g)
    nbd = Q * H // bs + 8
    dst = torch.randperm(nbd * bs, generator=g)[: Q * H]
    count = torch.tensor([H, 0, 1, H - 3, H, 500, H, 64], dtype=torch.int32)
    swap = (src.view(Q, H).int().to(DEV), dst.view(Q, H).int().to(DEV), count.to(DEV))
    pool = torch.randint(0, 256, (nbd, G, bs, rb), dtype=torch.uint8, device=DEV)
    a, b = pool.clone(), pool.clone()
    order = [G - 1 - j for j in range(G)]
    ref.gather_compact_group(span, [a[:, o] for o in order], *swap)
    tk.gather_compact_group(span, [b[:, o] for o in order], *swap)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and not torch.equal(a, pool)


@pytest.mark.parametrize("n,row_bytes", [(1, 768), (64, 768), (64, 192), (8192, 768)])
def test_scatter_rows_into_a_strided_pool(n: int, row_bytes: int) -> None:
    """A step's new GQA rows (768 B) and fp8 index keys (192 B) into pages strided as the
    pool's, skipped slots included; the whole pool compared against the reference."""
    g = torch.Generator(device="cuda").manual_seed(n + row_bytes)
    bs = 64
    nb = n // bs + 8
    pool = torch.randint(0, 256, (nb, bs * row_bytes + 256), generator=g, device="cuda")
    pool = pool.to(torch.uint8)
    values = torch.randint(0, 256, (n, row_bytes), generator=g, device="cuda").to(torch.uint8)
    slots = bs + torch.randperm((nb - 1) * bs, generator=g, device="cuda")[:n]
    slots[1::5] = -1
    out = []
    for fn in (ref.scatter_rows, tk.scatter_rows):
        p = pool.clone()
        fn(values, p[:, : bs * row_bytes].unflatten(1, (bs, row_bytes)), slots)
        out.append(p)
    assert torch.equal(out[0], out[1])
