"""The numba-compiled CPU batch-1 decode pieces (`hisparse.runtime.ops.cpu`) against the torch
code they stand in for: bit for bit where they claim it (fp8 encoding, rotation, written rows,
index keys),
the same choice where only the rounding of sums differs (selection), close where the
attention sums in another order. Fresh random inputs, outputs poisoned first; strided pools as
the engine's (a layer's pages between other layers' pages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse.attention.gqa_indexer_cpu import scored_topk_cpu
from hisparse.attention.gqa_indexer_keys import FP8_DTYPE, read_index_keys, write_index_keys
from hisparse.attention.gqa_indexer_reference import (
    GqaIndexerConfig,
    GqaIndexerFormat,
    gqa_indexer_topk,
)
from hisparse.attention.gqa_indexer_select import selection_masks
from hisparse.attention.sparse_gqa_reference import (
    GqaRowFormat,
    causal_gqa_cpu,
    sparse_gqa_reference,
    sparse_gqa_rows_cpu,
)
from hisparse.kv.row_formats import write_rows_fast
from hisparse.models.layers import full_width_rope, rope_full_width
from hisparse.runtime.ops import cpu_backend
from hisparse.runtime.ops.cpu import F32, layer_kernels, selection_kernels

fns = cpu_backend().jit()
pytestmark = pytest.mark.skipif(fns is None, reason="no numba (or HISPARSE_CPU_JIT=0)")

G, H, D = 3, 9, 64


def _set_jit(enabled: bool) -> None:
    cpu_backend().jit_enabled = enabled


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lut() -> np.ndarray:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(FP8_DTYPE).float().numpy()


def test_fp8_encode_is_torch_conversion() -> None:
    """Random values over every exponent, both signs, the exact midpoints between
    neighbouring e4m3 values (ties to even) and their fp32 neighbours, ±0, ±inf, NaN and
    values past the clamp: the byte of ``clamp(-448, 448).to(e4m3fn)`` every time."""
    g = np.random.default_rng(0)
    bits = g.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    values = [bits.view(np.float32)]
    grid = np.sort(np.unique(np.abs(_lut()[np.isfinite(_lut())])))
    mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2
    mids = mids.astype(np.float32)
    for m in (mids, -mids, grid, -grid):
        values += [m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf))]
    values.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448, 449, -500, 1e30], np.float32))
    x = np.concatenate(values).astype(np.float32)
    codes = np.full(x.shape, 0xAB, np.uint8)
    scratch = np.empty(x.shape, np.float32)
    fns_encode = layer_kernels._fp8_encode  # compiled by jit() (a helper of decode_pre)
    fns_encode(x, codes, scratch, scratch.view(np.uint32))
    want = torch.from_numpy(x.copy()).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8).numpy()
    assert np.array_equal(codes, want), np.flatnonzero(codes != want)[:10]


def _engine_like_pool(nb: int, bs: int, row_bytes: int, layers: int, layer: int) -> torch.Tensor:
    """One layer's ``[nb, bs, row_bytes]`` view of a pool that interleaves ``layers`` layers
    block by block (strided), filled with garbage."""
    pool = torch.randint(0, 256, (nb, layers, bs, row_bytes), dtype=torch.uint8, generator=_gen(9))
    return pool[:, layer]


@pytest.mark.parametrize("seed", range(3))
def test_decode_pre_writes_what_torch_writes(seed: int) -> None:
    """Rotated queries, the ``[k ‖ v]`` row and the fp8 index key equal `rope_full_width`,
    `GqaRowFormat.pack` and `write_index_keys` bit for bit; unscored, every position up to
    the query is chosen."""
    g = _gen(seed)
    bs, nb = 16, 6
    fmt_rows = GqaRowFormat(G, D, "fp32")
    cfg = GqaIndexerConfig(top_k=32, sink_tokens=4, recent_window=16)
    ifmt = GqaIndexerFormat.for_config(cfg, G, D)
    view = _engine_like_pool(nb, bs, fmt_rows.row_bytes, 3, 1)
    pages = torch.randint(0, 256, (nb, 2, ifmt.page_bytes(bs)), dtype=torch.uint8)[:, 0]
    qkv = torch.randn(1, (H + 2 * G) * D, generator=g) * 4
    pos = 37
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.tensor([float(pos)])[:, None] * inv[None, :]
    cos, sin = full_width_rope(freqs.cos(), freqs.sin())
    slot, islot = 2 * bs + 5, 3 * bs + 7
    q_out = np.full((H, D), np.nan, np.float32)
    chosen = np.full(pos + 3, 12345, np.int32)
    scratch = np.empty(G * D, np.float32)
    view_before, pages_before = view.clone(), pages.clone()
    ok = fns.decode_pre(
        qkv.numpy()[0], cos.numpy()[0], sin.numpy()[0], H, q_out,
        *cpu_backend().views.paged_rows(view, F32), slot,
        *cpu_backend().views.paged_pages(pages, ifmt.row_bytes), islot, np.empty(G * D, np.uint8),
        scratch, scratch.view(np.uint32), *cpu_backend().views.paged_pages(pages, ifmt.row_bytes),
        np.zeros(nb, np.int32), _lut(), pos + 1, pos, 4, 16, 32, D**-0.5, False, chosen,
    )  # fmt: skip
    assert ok
    q = rope_full_width(qkv[:, : H * D].view(1, H, D), cos, sin)
    k = rope_full_width(qkv[:, H * D : (H + G) * D].view(1, G, D), cos, sin)
    v = qkv[:, (H + G) * D :].view(1, G, D)
    assert torch.equal(torch.from_numpy(q_out), q[0])
    want_view = view_before.clone()
    want_view[slot // bs, slot % bs] = fmt_rows.pack(k, v)[0]
    assert torch.equal(view, want_view)
    want_pages = pages_before.clone()
    write_index_keys(want_pages, ifmt, torch.tensor([islot]), k)
    assert torch.equal(pages, want_pages)
    assert chosen.tolist() == [*range(pos + 1), -1, -1]


def _index_case(seed: int, length: int, bs: int = 16):
    cfg = GqaIndexerConfig(top_k=48, sink_tokens=4, recent_window=16)
    fmt = GqaIndexerFormat.for_config(cfg, G, D)
    nb = -(-length // bs)
    pool = torch.zeros(nb + 3, 2, fmt.page_bytes(bs), dtype=torch.uint8)
    pages = pool[:, 1]  # strided, as layers of a shared pool
    table = (torch.randperm(nb + 2, generator=_gen(seed))[:nb] + 1).to(torch.int32)
    pos = torch.arange(length)
    k = torch.randn(length, G, D, generator=_gen(seed + 1)) * 3
    write_index_keys(pages, fmt, table[pos // bs].long() * bs + pos % bs, k)
    q = torch.randn(1, H, D, generator=_gen(seed + 2)) * 3
    return cfg, fmt, pages, table, q


@pytest.mark.parametrize("seed", range(8))
def test_fp8_selection_equals_torch_selection(seed: int) -> None:
    """The compiled selection chooses exactly what `select_topk` does (random keys: no
    ties at the border), across lengths, and declines where a query has too few keys."""
    length = [60, 100, 177, 240][seed % 4]
    cfg, fmt, pages, table, q = _index_case(seed, length)
    p1 = torch.tensor([length - 1])
    masks = selection_masks(p1, length, H, cfg, check=True)
    _set_jit(False)
    try:
        want = gqa_indexer_topk(q, p1, pages, table, length, fmt, cfg, D**-0.5, 48, None, masks)
    finally:
        _set_jit(True)
    out = np.full(48, -7, np.int32)
    ok = fns.fp8_topk_row(
        q.view(G, H // G, D).numpy(), *cpu_backend().views.paged_pages(pages, fmt.row_bytes),
        table.numpy(), _lut(), length, length - 1, 4, 16, 48, D**-0.5, out,
    )  # fmt: skip
    assert ok and out.tolist() == want[0].tolist()
    # Through the dispatch in gqa_indexer_topk as well.
    got = gqa_indexer_topk(q, p1, pages, table, length, fmt, cfg, D**-0.5, 48)
    assert torch.equal(got, want)
    # A query with fewer than top_k keys up to it: declined, nothing written.
    out[:] = -7
    assert not fns.fp8_topk_row(
        q.view(G, H // G, D).numpy(), *cpu_backend().views.paged_pages(pages, fmt.row_bytes),
        table.numpy(), _lut(), length, 40, 4, 16, 48, D**-0.5, out,
    )  # fmt: skip
    assert (out == -7).all()


@pytest.mark.parametrize("masked", [False, True])
def test_attend_rows_matches_the_reference(masked: bool) -> None:
    """Attention over rows read in place from a strided pool equals `sparse_gqa_reference`
    (to rounding); masked entries (``-1``) are left out, NaN garbage in the pool included."""
    g = _gen(3)
    bs, nb, k = 16, 12, 70
    fmt = GqaRowFormat(G, D, "fp32")
    pool = torch.full((nb, 3, bs, fmt.row_bytes), 0xFF, dtype=torch.uint8)  # NaN garbage
    view = pool[:, 2]
    rows = torch.randperm(nb * bs, generator=g)[:k].to(torch.int32)
    kv = torch.randn(k, 2 * G * D, generator=g)
    for i, r in enumerate(rows.tolist()):
        view[r // bs, r % bs] = kv[i].view(torch.uint8)
    if masked:
        rows[::5] = -1
    q = torch.randn(1, H, D, generator=g)
    out = np.full((H, D), np.nan, np.float32)
    fns.attend_rows(q[0].numpy(), *cpu_backend().views.paged_rows(view, F32), rows.numpy(), D**-0.5,
                    out)  # fmt: skip
    want, _ = sparse_gqa_reference(q, view, rows[None], D**-0.5, fmt)
    torch.testing.assert_close(torch.from_numpy(out), want[0], rtol=1e-5, atol=1e-6)
    none = np.full((H, D), np.nan, np.float32)
    fns.attend_rows(q[0].numpy(), *cpu_backend().views.paged_rows(view, F32),
                    np.full(4, -1, np.int32), D**-0.5, none)  # fmt: skip
    assert (none == 0).all()


def test_paged_layouts_refuse_what_they_cannot_view() -> None:
    rows = torch.zeros(4, 16, 1536, dtype=torch.uint8)
    assert cpu_backend().views.paged_rows(rows[:, :, 1:1025], F32) is None  # not whole fp32 items
    flat, layout = cpu_backend().views.paged_rows(rows, F32)
    assert layout.tolist() == [0, 16 * 384, 384, 16, 384] and flat.dtype == np.float32
    assert cpu_backend().views.paged_pages(torch.zeros(4, 100, dtype=torch.uint8), 192) is None


def test_exp_shifted_is_within_an_ulp_and_zero_far_below() -> None:
    x = np.concatenate(
        [np.linspace(-100, 0, 200_001), [-np.inf, 0.0, -1e-30, -87.0, -86.99]]
    ).astype(np.float32)
    top = np.float32(2.5)
    y = x + top
    shifted = (y - top).astype(np.float64)  # the argument the kernel sees, exactly
    selection_kernels._exp_shifted(y, top, np.empty_like(y))  # compiled by jit() (a helper)
    want = np.exp(shifted)
    x = shifted
    live = x > -87
    rel = np.abs(y[live] - want[live]) / want[live]
    assert rel.max() < 2**-23  # under one ulp of the result
    assert (y[~live] == 0).all() and y[-4] == 1.0


def test_add_rms_norm_matches_rms_norm() -> None:
    """The add is exact; the norm equals ``F.rms_norm`` to a few ulp (its sum of squares
    rounds in another order)."""
    g = _gen(11)
    for scale in (0.05, 1.0, 30.0):
        x, delta, w = (
            torch.randn(576, generator=g) * scale,
            torch.randn(576, generator=g),
            (torch.randn(576, generator=g)),
        )
        xo, h = torch.full((576,), np.nan), torch.full((576,), np.nan)
        fns.add_rms_norm(x.numpy(), delta.numpy(), True, w.numpy(), np.float32(1e-5),
                         xo.numpy(), h.numpy())  # fmt: skip
        assert torch.equal(xo, x + delta)
        want = torch.nn.functional.rms_norm(x + delta, (576,), w, 1e-5)
        torch.testing.assert_close(h, want, rtol=1e-6, atol=1e-7)
        fns.add_rms_norm(x.numpy(), x.numpy(), False, w.numpy(), np.float32(1e-5), xo.numpy(),
                         h.numpy())  # fmt: skip
        assert torch.equal(xo, x)


# ---------------------------------------------------------------------------------------------
# CPU prefill: the compiled selection and attention of many tokens
# ---------------------------------------------------------------------------------------------
def _prefill_index_case(seed: int, length: int, method: str, bs: int = 16):
    """A request of ``length`` keys in strided pages behind a shuffled block table, and one
    query per position."""
    cfg = GqaIndexerConfig(top_k=48, method=method, sink_tokens=4, recent_window=16)
    fmt = GqaIndexerFormat.for_config(cfg, G, D)
    nb = -(-length // bs)
    pages = torch.zeros(nb + 3, 2, fmt.page_bytes(bs), dtype=torch.uint8)[:, 1]
    table = (torch.randperm(nb + 2, generator=_gen(seed))[:nb] + 1).to(torch.int32)
    pos = torch.arange(length)
    dims = torch.arange(2 * cfg.lowrank_pairs).expand(G, -1) if method == "lowrank" else None
    k = torch.randn(length, G, D, generator=_gen(seed + 1)) * 3
    write_index_keys(pages, fmt, table[pos // bs].long() * bs + pos % bs, k, dims)
    q = torch.randn(length, H, D, generator=_gen(seed + 2)) * 3
    return cfg, fmt, pages, table, q, dims


@pytest.mark.parametrize("method", ["fp8", "lowrank"])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_selection_equals_torch_selection(method: str, seed: int) -> None:
    """A prefill's scored queries (chunked matmul logits, then `topk_rows`) choose exactly
    what the torch path (`approx_logits`, `select_topk`) does; early queries stay dense."""
    length = [150, 201, 333][seed]
    cfg, fmt, pages, table, q, dims = _prefill_index_case(seed, length, method)
    pos = torch.arange(length)
    _set_jit(False)
    try:
        want = gqa_indexer_topk(q, pos, pages, table, length, fmt, cfg, D**-0.5, 48, dims)
    finally:
        _set_jit(True)
    got = gqa_indexer_topk(q, pos, pages, table, length, fmt, cfg, D**-0.5, 48, dims)
    assert torch.equal(got, want)


def test_prefill_selection_does_not_depend_on_the_chunking() -> None:
    """Each query's selection is the same whether it is scored with all the prompt's
    queries, in engine-sized chunks, alone, or in another order (chunked prefill = one step):
    bit for bit, since each query's logits and sums do not depend on the others."""
    length = 300
    cfg, fmt, pages, table, q, _ = _prefill_index_case(7, length, "fp8")
    pos = torch.arange(length)
    scored = pos >= cfg.top_k
    keys = read_index_keys(pages, fmt, table, length)

    def select(idx: torch.Tensor) -> torch.Tensor:
        out = scored_topk_cpu(q[idx], pos[idx], keys, fmt, cfg, D**-0.5, 48, None)
        assert out is not None
        return out

    whole = select(torch.nonzero(scored).flatten())
    first = int(cfg.top_k)
    for lo, hi in ((first, 100), (100, 101), (101, 257), (257, 300), (299, 300)):
        assert torch.equal(select(torch.arange(lo, hi)), whole[lo - first : hi - first])
    perm = torch.randperm(length - first, generator=_gen(8))
    assert torch.equal(select(perm + first), whole[perm])
    # A query before position top_k is not scored: declined.
    assert scored_topk_cpu(q[:3], pos[:3], keys, fmt, cfg, D**-0.5, 48, None) is None


@pytest.mark.parametrize("masked", [False, True])
def test_prefill_attention_matches_the_reference(masked: bool) -> None:
    """`sparse_gqa_rows_cpu` (each token over its own rows, read in place from a strided
    pool with NaN garbage) equals `sparse_gqa_reference` to rounding; a token whose rows
    are all masked gets 0; rows it cannot read (bf16) are declined."""
    g = _gen(13)
    bs, nb, t, k = 16, 12, 40, 70
    fmt = GqaRowFormat(G, D, "fp32")
    pool = torch.full((nb, 3, bs, fmt.row_bytes), 0xFF, dtype=torch.uint8)  # NaN garbage
    view = pool[:, 1]
    live = torch.randperm(nb * bs, generator=g)[: 2 * k].to(torch.int32)
    for r in live.tolist():
        view[r // bs, r % bs] = torch.randn(2 * G * D, generator=g).view(torch.uint8)
    rows = torch.stack([live[torch.randperm(2 * k, generator=g)[:k]] for _ in range(t)])
    if masked:
        rows[:, ::3] = -1
        rows[5] = -1
    q = torch.randn(t, H, D, generator=g)
    got = sparse_gqa_rows_cpu(q, view, rows, D**-0.5, fmt)
    want, _ = sparse_gqa_reference(q, view, rows, D**-0.5, fmt)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if masked:
        assert (got[5] == 0).all()
    bf16 = GqaRowFormat(G, D, "bf16")
    assert sparse_gqa_rows_cpu(q, view[:, :, : bf16.row_bytes], rows, D**-0.5, bf16) is None


def test_resident_rows_is_the_block_table_lookup() -> None:
    """`resident_rows` kernel: each live entry through its request's resident block table,
    ``-1`` for padding entries and padding tokens; declined for a page that is not resident
    or lies past the table."""
    g = _gen(17)
    bs, n, k = 16, 30, 20
    table = torch.randint(1, 50, (3, 6), dtype=torch.int32, generator=g)
    req = torch.randint(0, 3, (n,), dtype=torch.int32, generator=g)
    req[4] = -1
    topk = torch.randint(0, 6 * bs, (n, k), dtype=torch.int32, generator=g)
    topk[:, ::4] = -1
    out = np.full((n, k), 7, np.int32)
    assert fns.resident_rows(topk.numpy(), req.numpy(), table.numpy(), bs, out)
    pos = topk.long().clamp_min(0)
    want = table[req.long().clamp_min(0)[:, None], pos // bs].long() * bs + pos % bs
    want = torch.where((topk >= 0) & (req >= 0)[:, None], want, -1)
    assert torch.equal(torch.from_numpy(out).long(), want)
    table[req[0], topk[0, 1] // bs] = 0  # a page left the GPU
    assert not fns.resident_rows(topk.numpy(), req.numpy(), table.numpy(), bs, out)
    table[req[0], topk[0, 1] // bs] = 1
    topk[0, 1] = 6 * bs  # past the table
    assert not fns.resident_rows(topk.numpy(), req.numpy(), table.numpy(), bs, out)


def test_causal_prefix_attention_matches_the_reference() -> None:
    """`causal_gqa_cpu`: tokens that each attend to every position up to their own, over a
    request's rows in a strided pool, equal `sparse_gqa_reference` to rounding; a later
    chunk of the same tokens (masked by position) gives the whole prompt's rows bit for
    bit; rows that are not such a prefix are declined."""
    g = _gen(19)
    bs, nb, n = 16, 8, 90
    fmt = GqaRowFormat(G, D, "fp32")
    view = torch.full((nb, 2, bs, fmt.row_bytes), 0xFF, dtype=torch.uint8)[:, 0]
    rows = (torch.randperm(nb * bs, generator=g)[:n]).to(torch.int32)  # position -> row
    for r in rows.tolist():
        view[r // bs, r % bs] = torch.randn(2 * G * D, generator=g).view(torch.uint8)
    pos = torch.arange(n)
    idx = torch.full((n, n + 10), -1, dtype=torch.int32)  # each token's rows, -1 padded
    for t in range(n):
        idx[t, : t + 1] = rows[: t + 1]
    q = torch.randn(n, H, D, generator=g)
    got = causal_gqa_cpu(q, view, idx, pos, D**-0.5, fmt)
    want, _ = sparse_gqa_reference(q, view, idx, D**-0.5, fmt)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    late = causal_gqa_cpu(q[40:], view, idx[40:], pos[40:], D**-0.5, fmt)
    assert late is not None and torch.equal(late, got[40:])
    idx[7, 3] = rows[5]  # not the prefix of positions
    assert causal_gqa_cpu(q, view, idx, pos, D**-0.5, fmt) is None


def test_write_rows_many_writes_what_torch_writes() -> None:
    """A prefill's rows and fp8 index keys, written in one compiled call from strided
    ``k``/``v`` views into strided pools, equal `write_rows_fast` of `GqaRowFormat.pack`
    and `write_index_keys` byte for byte (slots ``< 0`` skipped); a slot past the view is
    refused before anything is written."""
    g = _gen(23)
    bs, nb, n = 16, 6, 50
    fmt_rows = GqaRowFormat(G, D, "fp32")
    ifmt = GqaIndexerFormat.for_config(GqaIndexerConfig(), G, D)
    view = _engine_like_pool(nb, bs, fmt_rows.row_bytes, 3, 1)
    pages = torch.randint(0, 256, (nb, 2, ifmt.page_bytes(bs)), dtype=torch.uint8)[:, 0]
    qkv = torch.randn(n, H + 2 * G, D, generator=g) * 40  # some keys past the fp8 clamp
    k, v = qkv[:, H : H + G], qkv[:, H + G :]
    slots = torch.randperm(nb * bs, generator=g)[:n].to(torch.int32)
    islots = torch.randperm(nb * bs, generator=g)[:n].to(torch.int32)
    slots[3], islots[5] = -1, -1
    want_view, want_pages = view.clone(), pages.clone()
    write_rows_fast(want_view, slots, fmt_rows.pack(k, v))
    write_index_keys(want_pages, ifmt, islots, k)
    views = cpu_backend().views
    rows, keys = views.paged_rows(view, F32), views.paged_pages(pages, ifmt.row_bytes)
    assert fns.write_rows_many(k.numpy(), v.numpy(), *rows, nb, slots.numpy(), *keys, nb,
                               islots.numpy())  # fmt: skip
    assert torch.equal(view, want_view) and torch.equal(pages, want_pages)
    before = view.clone()
    slots[0] = nb * bs
    assert not fns.write_rows_many(k.numpy(), v.numpy(), *rows, nb, slots.numpy(), *keys, nb,
                                   islots.numpy())  # fmt: skip
    assert torch.equal(view, before)


def test_omp_num_threads_one_stays_one_thread() -> None:
    """Starting numba's OpenMP pool sets the runtime it shares with torch to
    ``NUMBA_NUM_THREADS`` threads; `CpuBackend.parts` puts torch's count back, so a process
    run with ``OMP_NUM_THREADS=1`` computes on one thread (a fresh process: this session
    started numba's pool already)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, numba\n"
        "from hisparse.runtime.ops import cpu_backend\n"
        "print(cpu_backend().parts(), torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    parts, threads, numba_threads = map(int, out.stdout.split())
    assert (parts, threads) == (1, 1) and numba_threads == os.cpu_count()
