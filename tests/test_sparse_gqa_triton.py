"""Triton sparse GQA decode equals the reference (Triton's CPU interpreter, CI).

``TRITON_INTERPRET=1`` is set before the kernel module is imported. Every case draws fresh
random K/V rows in the real GQA row format (`GqaRowFormat.pack`: K then V of every KV head),
queries and indices (with ``-1`` entries and an all-masked token), reads the rows through a
strided (token-interleaved) view of the pool filled with random garbage bytes, and checks that
NaN-poisoned outputs are fully written.

Tolerances: under the interpreter the kernel's dots run in fp32, so against the fp32 reference
it differs by summation order only (abs/rel 1e-5). bf16 queries give a bf16 output; the
interpreter's bf16 cast truncates (one bf16 ulp, 2^-7 relative) where torch rounds to nearest,
hence abs 1e-3 / rel 1.6e-2 there. ``lse`` is fp32 in both: 1e-5.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention import sparse_gqa_triton as sgt
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention import triton_split
from hisparse.attention.dispatch import sparse_gqa_decode
from hisparse.attention.sparse_gqa_reference import GqaRowFormat, sparse_gqa_reference

pytestmark = pytest.mark.skipif(
    not smt.interpreting(), reason="Triton kernels were defined outside the interpreter"
)

G, D = 3, 64  # SmolLM2's KV heads and head dim


def _pool(fmt: GqaRowFormat, nb: int, bs: int, g: torch.Generator) -> torch.Tensor:
    """A ``[nb, bs, row_bytes]`` view with a token stride of two rows over garbage bytes."""
    k = torch.randn(nb * bs, fmt.num_kv_heads, fmt.head_dim, generator=g) * 2
    v = torch.randn(nb * bs, fmt.num_kv_heads, fmt.head_dim, generator=g)
    rows = fmt.pack(k, v).view(nb, bs, -1)
    big = torch.randint(0, 255, (nb, 2 * bs, fmt.row_bytes), generator=g, dtype=torch.uint8)
    big[:, ::2] = rows
    return big[:, ::2]


def _indices(t: int, k: int, rows: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.randperm(rows, generator=g)[:k].repeat(t, 1).to(torch.int32)
    idx = idx[:, torch.randperm(k, generator=g)]
    idx[torch.rand(t, k, generator=g) < 0.25] = -1
    if t > 1:
        idx[t - 1] = -1  # an all-masked token: out 0, lse -inf
    return idx


def _run(rows: str, t: int, h: int, k: int, dtype: torch.dtype, seed: int, d: int = D, *,
         head_major: bool = False, **kw) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``head_major``: q a view of an ``[H, T, D]`` buffer (any q strides are allowed)."""
    g = torch.Generator().manual_seed(seed)
    fmt = GqaRowFormat(G, d, rows)
    nb, bs = 6, 8
    kv = _pool(fmt, nb, bs, g)
    idx = _indices(t, k, nb * bs, g)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    if head_major:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    scale = d**-0.5
    ref_o, ref_l = sparse_gqa_reference(q, kv, idx, scale, fmt)
    out, lse = sgt.sparse_gqa_decode_triton(q, kv, idx, scale, fmt, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref_o.float(), **tol)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)
    if t > 1:
        assert torch.equal(out[t - 1], torch.zeros_like(out[t - 1]))
        assert torch.isneginf(lse[t - 1]).all()
    return out, lse


@pytest.mark.parametrize("rows", ["bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(rows: str, dtype: torch.dtype, splits: int) -> None:
    seed = 10 * (rows == "bf16") + 5 * (dtype == torch.bfloat16) + splits
    cfg = sgt.GqaDecodeConfig(block_n=8)
    _run(rows, 3, 9, 40, dtype, seed, num_splits=splits, config=cfg)


@pytest.mark.parametrize("seed", range(3))
def test_decode_random_shapes(seed: int) -> None:
    """Random token counts, group sizes (1..5 query heads per KV head), top-k and head dims;
    default tile shape and split count (indices and heads padded and masked in the kernel)."""
    g = torch.Generator().manual_seed(500 + seed)
    t = int(torch.randint(1, 4, (1,), generator=g))
    group = int(torch.randint(1, 6, (1,), generator=g))
    k = int(torch.randint(1, 48, (1,), generator=g))
    d = [16, 32, 64][seed]
    _run(["bf16", "fp32", "fp16"][seed], t, G * group, k, torch.float32, seed, d=d)


def test_more_splits_than_tiles_gives_empty_splits() -> None:
    """A split past the last index contributes nothing (lse -inf), not NaN."""
    _run("bf16", 2, 9, 9, torch.float32, 77, num_splits=4, config=sgt.GqaDecodeConfig(8))


def test_poisoned_outputs_are_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element of out / lse is written, also through the combine step (NaN-filled
    allocations: an unwritten element would fail the comparison)."""
    _poison_empty(monkeypatch)
    for splits in (1, 2):
        _run("bf16", 3, 9, 24, torch.float32, 90 + splits, num_splits=splits,
             config=sgt.GqaDecodeConfig(8))  # fmt: skip


def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN-filled floats: an element no kernel writes fails a check."""
    real_empty = torch.empty

    def poisoned(*a, **kw):  # type: ignore[no-untyped-def]
        x = real_empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("splits", [1, 3])
def test_tokens_past_the_grid_limit_run_in_slices(
    splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More tokens than grid axis 1 takes (CUDA: 65535; lowered to 2 here) run as launches
    over token slices, partials and combine included: every element written (NaN-poisoned
    allocations), bit-equal to one launch over all tokens, and the reference's (in `_run`);
    q head-major there (slices of a strided view)."""
    args = ("bf16", 5, 9, 24, torch.float32, 140 + splits)
    cfg = sgt.GqaDecodeConfig(8)
    whole = _run(*args, num_splits=splits, config=cfg)
    launches: list[list[tuple[int, int]]] = []
    real = triton_split.grid_slices
    monkeypatch.setattr(triton_split, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(sgt, "grid_slices", lambda n: launches.append(real(n)) or launches[-1])
    _poison_empty(monkeypatch)
    out, lse = _run(*args, num_splits=splits, config=cfg, head_major=True)
    assert launches == [[(0, 2), (2, 4), (4, 5)]]
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])


def test_fp16_rows_and_queries() -> None:
    _run("fp16", 2, 6, 20, torch.float16, 31, config=sgt.GqaDecodeConfig(8))


def test_dispatch_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(sgt, "sparse_gqa_decode_triton", lambda *a, **k: calls.append(1))
    g = torch.Generator().manual_seed(3)
    fmt = GqaRowFormat(G, D, "bf16")
    kv = _pool(fmt, 2, 8, g)
    q = torch.randn(1, 9, D, generator=g)
    idx = torch.arange(8, dtype=torch.int32)[None]
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    out, _ = sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)
    assert not calls and out.shape == (1, 9, D)
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)
    assert calls == [1]
    # A head dim that is not a power of two is not a kernel shape: reference even when forced.
    odd = GqaRowFormat(G, 24, "bf16")
    sparse_gqa_decode(torch.randn(1, 9, 24), _pool(odd, 2, 8, g), idx, 0.2, odd)
    assert calls == [1]
    monkeypatch.setenv("HISPARSE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="HISPARSE_ATTENTION"):
        sparse_gqa_decode(q, kv, idx, D**-0.5, fmt)


def test_rejects_unsupported_inputs() -> None:
    fmt = GqaRowFormat(G, D, "bf16")
    kv = torch.zeros(2, 8, fmt.row_bytes, dtype=torch.uint8)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="Triton sparse GQA"):
        sgt.sparse_gqa_decode_triton(torch.zeros(1, 8, D), kv, idx, 0.1, fmt)  # 8 % 3 heads
    with pytest.raises(ValueError, match="shapes disagree"):
        sgt.sparse_gqa_decode_triton(torch.zeros(2, 9, D), kv, idx, 0.1, fmt)


# ---------------------------------------------------------------------------------------------
# Callers: the batched decode indexer and the model's decode path through the kernel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fp8", "lowrank", "quest"])
def test_batched_decode_indexer_equals_per_request(method: str) -> None:
    """`gqa_indexer_topk_decode` (one scoring for a whole decode step, keys padded to the
    longest request or a larger bound, unwritten pages NaN) selects what `gqa_indexer_topk`
    selects request by request."""
    from hisparse.attention.dispatch import gqa_indexer_topk_decode
    from hisparse.attention.gqa_indexer_keys import write_index_keys
    from hisparse.attention.gqa_indexer_reference import (
        GqaIndexerConfig,
        GqaIndexerFormat,
        gqa_indexer_topk,
    )

    g = torch.Generator().manual_seed(11)
    cfg = GqaIndexerConfig(
        top_k=24, method=method, sink_tokens=2, recent_window=16, lowrank_pairs=2
    )
    fmt = GqaIndexerFormat.for_config(cfg, G, 16)
    bs, h = 16, 6
    lengths = [70, 20, 45, 24]  # two sparse requests, two that fit in top_k
    nb = 24
    pages = torch.full((nb, fmt.page_bytes(bs)), 0xFF, dtype=torch.uint8)  # NaN garbage
    tables = torch.zeros(len(lengths), 6, dtype=torch.long)
    free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    dims = torch.stack([torch.randperm(8, generator=g)[:2].sort().values for _ in range(G)])
    dims = torch.cat((dims, dims + 8), dim=1) if method == "lowrank" else None
    for r, n in enumerate(lengths):
        for b in range(-(-n // bs)):
            tables[r, b] = free.pop()
        pos = torch.arange(n)
        slots = tables[r, pos // bs] * bs + pos % bs
        write_index_keys(pages, fmt, slots, torch.randn(n, G, 16, generator=g) * 2, dims)
    q = torch.randn(len(lengths), h, 16, generator=g)
    positions = torch.tensor(lengths) - 1
    width = 24
    got = gqa_indexer_topk_decode(q, positions, pages, tables, torch.tensor(lengths),
                                  max(lengths), fmt, cfg, 0.25, width, dims)  # fmt: skip
    # A larger host bound (the static CUDA-graph step passes the table's capacity): same.
    bound = gqa_indexer_topk_decode(q, positions, pages, tables, torch.tensor(lengths),
                                    6 * bs, fmt, cfg, 0.25, width, dims)  # fmt: skip
    assert torch.equal(bound, got)
    for r, n in enumerate(lengths):
        want = gqa_indexer_topk(q[r : r + 1], positions[r : r + 1], pages, tables[r], n, fmt,
                                cfg, 0.25, width, dims)  # fmt: skip
        assert torch.equal(got[r : r + 1], want), (r, got[r], want)


def test_model_decode_through_the_kernel_matches_reference(monkeypatch: pytest.MonkeyPatch):
    """A tiny random Llama prefills and decodes (sparse and dense requests in one batch) with
    the Triton kernel forced (interpreter; the prefill runs it with one row per token) and
    with the reference: the same logits up to fp32 rounding, and the kernel really ran."""
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
    from hisparse.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = LlamaForCausalLM(cfg, GqaIndexerConfig(top_k=20, sink_tokens=2, recent_window=8))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (30, 9, 25)]
    calls = []
    real = sgt.sparse_gqa_decode_triton
    monkeypatch.setattr(
        sgt, "sparse_gqa_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )

    def logits(backend: str) -> torch.Tensor:
        monkeypatch.setenv("HISPARSE_ATTENTION", backend)
        cache = model.new_dense_cache(max_reqs=3, max_len=40, block_size=4)
        step = cache.begin_step([0, 1, 2], [len(p) for p in prompts])
        model(torch.tensor([t for p in prompts for t in p]), step, cache)
        outs = []
        for i in range(3):  # three decode steps of all three requests
            step = cache.begin_step([0, 1, 2], [1, 1, 1])
            outs.append(model.logits(model(torch.tensor([5 + i, 7, 9]), step, cache)))
        return torch.stack(outs)

    ref = logits("reference")
    assert not calls
    got = logits("triton")
    assert len(calls) == (1 + 3) * cfg.num_hidden_layers  # the prefill, one row per token
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_static_decode_step_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-shape decode step of the CUDA-graph path (`ForwardStep.static`: a padded batch,
    no host reads, keys bounded by ``max_len``) gives the eager step's logits for the real rows
    (summation order aside) through the Triton kernel, and padding rows change nothing."""
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
    from hisparse.models.kv_access import ForwardStep
    from hisparse.models.llama import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = LlamaForCausalLM(cfg, GqaIndexerConfig(top_k=20, sink_tokens=2, recent_window=8))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (30, 9, 25)]

    def prefilled():
        cache = model.new_dense_cache(max_reqs=3, max_len=40, block_size=4)
        step = cache.begin_step([0, 1, 2], [len(p) for p in prompts])
        model(torch.tensor([t for p in prompts for t in p]), step, cache)
        return cache

    cache = prefilled()
    step = cache.begin_step([0, 1, 2], [1, 1, 1])
    want = model.logits(model(torch.tensor([5, 7, 9]), step, cache))

    cache = prefilled()
    step = cache.begin_step([0, 1, 2], [1, 1, 1])
    kv, idx = cache.attention(0), cache.indexer(0)
    _, slots = kv.write_target()
    # Pad to 4 rows: row 3 is no request (req_index -1, slot -1, length 0).
    pad = ForwardStep(
        positions=torch.cat((step.positions, torch.zeros(1, dtype=torch.long))),
        req_index=torch.tensor([0, 1, 2, -1]),
        seq_lens=torch.cat((step.seq_lens, torch.zeros(1, dtype=torch.long))),
        max_len=40,
        static=True,
    )

    class Padded:
        """The dense cache's step views with one padding row appended."""

        row_format, indexer_format = cache.row_format, cache.indexer_format

        def attention(self, layer):
            return _PadLayer(cache.attention(layer))

        def indexer(self, layer):
            return _PadIndexer(cache.indexer(layer))

    got = model.logits(model(torch.tensor([5, 7, 9, 11]), pad, Padded()))
    assert slots.shape[0] == 3 and idx is not None
    torch.testing.assert_close(got[:3], want, atol=1e-4, rtol=1e-4)


class _PadLayer:
    def __init__(self, inner) -> None:
        self.inner = inner

    def write_target(self):
        view, slots = self.inner.write_target()
        return view, torch.cat((slots, torch.full((1,), -1, dtype=slots.dtype)))

    def finish_kv_update(self) -> None:
        self.inner.finish_kv_update()

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        assert torch.equal(logical_topk[3], torch.full_like(logical_topk[3], -1))
        return torch.cat((self.inner.swap_in(logical_topk[:3]), logical_topk[3:]))


class _PadIndexer:
    def __init__(self, inner) -> None:
        self.inner = inner

    def write_target(self):
        pages, slots = self.inner.write_target()
        return pages, torch.cat((slots, torch.full((1,), -1, dtype=slots.dtype)))

    def read_source(self):
        pages, table = self.inner.read_source()
        return pages, torch.cat((table, torch.zeros_like(table[:1])))
