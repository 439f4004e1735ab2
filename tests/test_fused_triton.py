"""The fused layer kernels (`hisparse.models.fused_triton`, `fused_indexer_triton`,
`fused_ffn_triton`) against their torch references
(`hisparse.models.fused` with ``HISPARSE_FUSED=reference``), in Triton's CPU interpreter:
fresh random inputs, strided inputs, bf16 and fp32, skipped slots, outputs and pages poisoned
first (the whole destination is compared, so a stray write shows). Then the e4m3 encoder over
every boundary, the power-of-two scale rule, the batched MoE against the per-expert loop, and
a whole DSA model with the fused ops against the references.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.kv.row_formats import IndexerCacheFormat, ceil_pow2, mla_row_bytes
from hisparse.models import fused
from hisparse.models import fused_ffn_triton as ffn
from hisparse.models import fused_triton as ft
from hisparse.models.layers import RMSNorm
from hisparse.testing.fused_cases import (
    assert_indexer_keys_close,
    assert_mla_rows_match,
    reference_and_kernel,
)

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)

DTYPES = (torch.bfloat16, torch.float32)


def _angles(n: int, half: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    ang = torch.rand(n, half, generator=g) * 50
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _norm(d: int, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 576, 7168])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(monkeypatch, dtype, d, residual) -> None:
    g = torch.Generator().manual_seed(d + residual)
    x = (torch.randn(5, d + 40, generator=g) * 3).to(dtype)[:, :d]  # strided rows
    r = (torch.randn(5, d, generator=g) * 3).to(dtype) if residual else None
    norm = _norm(d, dtype, g)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.add_rms_norm, norm, x, r)
    assert torch.equal(ref[0], got[0])  # the residual sum: one rounding each way
    # The mean's sum runs in another order: an ulp of the norm, two of the output at most.
    ulp = 2**-6 if dtype == torch.bfloat16 else 2**-21
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=ulp, atol=1e-6)
    assert got[1].dtype == ref[1].dtype and got[1].shape == ref[1].shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_is_bit_exact(monkeypatch, dtype, interleaved) -> None:
    g = torch.Generator().manual_seed(int(interleaved))
    q = (torch.randn(7, 20, 192, generator=g) * 4).to(dtype)[..., 128:]  # the q_pe split
    cos, sin = _angles(7, 32, dtype, g)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.rope, q, cos, sin, interleaved)
    assert torch.equal(ref, got) and got.is_contiguous()


def _indexer_inputs(shape, dtype, g):  # type: ignore[no-untyped-def]
    x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(
        -2, 3, (*shape[:-1], 1), generator=g
    )
    x = x.to(dtype)
    x.view(-1, shape[-1])[0] = 0.0  # an all-zero row: the scale floor
    x.view(-1, shape[-1])[1, :8] = 300.0  # a large one
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("d,rope_dim", [(128, 64), (64, 16)])
@pytest.mark.parametrize("stacked", [False, True])
def test_indexer_query_is_bit_exact(monkeypatch, dtype, interleaved, d, rope_dim, stacked) -> None:
    """``stacked``: the queries are the tail of a stacked projection's rows (``q_b_proj``
    beside them), as `MLAttention.stack_projections` hands them over: strided tokens."""
    g = torch.Generator().manual_seed(d + stacked)
    q = _indexer_inputs((9, 16, d), dtype, g)
    if stacked:
        rows = torch.randn(9, 40 + 16 * d, generator=g).to(dtype)
        rows[:, 40:] = q.reshape(9, -1)
        q = rows[:, 40:].view(9, 16, d)
        assert not q.is_contiguous()
    cos, sin = _angles(9, rope_dim // 2, dtype, g)
    tile = min(128, d)
    (ref, _), (got, _) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_query, q, cos, sin, rope_dim, interleaved, tile
    )
    assert torch.equal(ref[0].view(torch.uint8), got[0].view(torch.uint8))
    assert torch.equal(ref[1], got[1]) and got[1].shape == (9, 16, d // tile)


@pytest.mark.parametrize("tokens", [1, 9])
def test_indexer_query_rows_per_program(monkeypatch, tokens: int) -> None:
    """One token's 64 head rows two per program, 9 tokens' 576 rows 16 per program (the
    test above: 4 per program): the same bits as the reference."""
    g = torch.Generator().manual_seed(tokens)
    q = _indexer_inputs((tokens, 64, 128), torch.bfloat16, g)
    cos, sin = _angles(tokens, 32, torch.bfloat16, g)
    (ref, _), (got, _) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_query, q, cos, sin, 64, False, 128
    )
    assert torch.equal(ref[0].view(torch.uint8), got[0].view(torch.uint8))
    assert torch.equal(ref[1], got[1])


@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_keys_written_bit_exact(monkeypatch, interleaved) -> None:
    g = torch.Generator().manual_seed(3)
    fmt = IndexerCacheFormat.for_mode("fp8", 128)
    bs = 16
    pages = torch.randint(0, 256, (6, bs * fmt.row_bytes), dtype=torch.uint8, generator=g)
    k = _indexer_inputs((7, 128), torch.bfloat16, g)
    cos, sin = _angles(7, 32, torch.bfloat16, g)
    slots = torch.tensor([3, 17, -1, 40, 95, 16, 1])  # block 0 row 0: the null row
    (_, ref), (_, got) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_write_keys, k, cos, sin, 64, interleaved, pages, fmt, slots
    )
    assert torch.equal(ref[5], got[5])  # the whole pages, skipped slot and untouched rows too
    assert not torch.equal(got[5], pages)


def _layer_norm(d: int, dtype: torch.dtype, g: torch.Generator) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(d, eps=1e-6)
    norm.weight.data = torch.randn(d, generator=g) * 0.3 + 1
    norm.bias.data = torch.randn(d, generator=g) * 0.1
    return norm.to(dtype)


@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_keys_with_their_layer_norm(monkeypatch, interleaved) -> None:
    """The keys' LayerNorm inside the kernel: its statistics sum in another order than
    torch's, so a normed value can move by an ulp and an e4m3 byte by one step; the keys read
    back agree to that, every written row has its scales, the rest of the pages is untouched."""
    g = torch.Generator().manual_seed(4)
    fmt = IndexerCacheFormat.for_mode("fp8", 128)
    bs = 16
    pages = torch.randint(0, 256, (6, bs * fmt.row_bytes), dtype=torch.uint8, generator=g)
    k = (torch.randn(7, 300, generator=g) * 3).to(torch.bfloat16)[:, 100:228]  # strided rows
    cos, sin = _angles(7, 32, torch.bfloat16, g)
    norm = _layer_norm(128, torch.bfloat16, g)
    slots = torch.tensor([3, 17, -1, 40, 95, 16, 1])
    (_, ref), (_, got) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_write_keys, k, cos, sin, 64, interleaved, pages, fmt,
        slots, norm,
    )  # fmt: skip
    assert_indexer_keys_close(ref[5], got[5], pages, fmt, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(monkeypatch, dtype) -> None:
    """``silu(gate) * up``: fp32 within an ulp (the interpreter's exp is numpy's, torch's CPU
    one is Sleef's; on CUDA both are ``expf``), bf16 within one bf16 ulp."""
    g = torch.Generator().manual_seed(6)
    two = (torch.randn(9, 2 * 96 + 40, generator=g) * 4).to(dtype)[:, : 2 * 96]  # strided rows
    three = (torch.randn(3, 5, 2 * 40, generator=g) * 4).to(dtype)  # the batched experts'
    for x in (two, three):
        (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.silu_mul, x)
        assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
        torch.testing.assert_close(got.float(), ref.float(), rtol=ulp, atol=1e-6)


def test_indexer_head_weights(monkeypatch) -> None:
    """The indexer's fp32 head weights from bf16 rows: a decode step's rows in one kernel
    (the dot products' sum order differs from the BLAS), a prefill's through the reference."""
    g = torch.Generator().manual_seed(7)
    proj = torch.nn.Linear(7168, 64, bias=False)
    proj.weight.data = torch.randn(64, 7168, generator=g) * 0.02
    for n in (5, 29):  # one program per (row, head); tiles of rows x heads
        x = (torch.randn(n, 7300, generator=g)).to(torch.bfloat16)[:, :7168]  # strided rows
        (ref, _), (got, _) = reference_and_kernel(
            monkeypatch, fused.indexer_head_weights, proj, x, 0.125
        )
        assert got.dtype == torch.float32 and got.shape == (n, 64)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    many = torch.randn(fused.HEAD_WEIGHTS_MAX_ROWS + 1, 7168, generator=g).to(torch.bfloat16)
    (ref, _), (got, _) = reference_and_kernel(
        monkeypatch, fused.indexer_head_weights, proj, many, 0.125
    )
    assert torch.equal(ref, got)


@pytest.mark.parametrize("row_format", ["fp8_ds_mla", "bf16"])
def test_mla_rows_written_like_the_reference(monkeypatch, row_format) -> None:
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    rb = mla_row_bytes(row_format, 512, 64)
    bs = 16
    view = torch.randint(0, 256, (6, bs, rb + 16), dtype=torch.uint8, generator=g)[:, :, :rb]
    kv = (torch.randn(8, 700, generator=g) * 4).to(dtype)[:, :576]  # strided rows
    kv[1, :512] = 0.0  # a zero latent: fp8 scale 0
    norm = _norm(512, dtype, g)
    cos, sin = _angles(8, 32, dtype, g)
    slots = torch.tensor([3, 17, -1, 40, 95, 16, 1, 50])  # block 0 row 0: the null row
    (_, ref), (_, got) = reference_and_kernel(
        monkeypatch, fused.write_mla_rows, kv, norm, cos, sin, view, slots, row_format
    )
    assert_mla_rows_match(ref[4], got[4], view, slots, row_format)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_rope_write_is_bit_exact(monkeypatch, dtype) -> None:
    """q, the K/V rows and the e4m3 index keys as the torch composition writes them: strided
    qkv rows, layer views strided in the shared pool, poisoned pages, skipped slots, keys
    beyond the e4m3 range (clamped)."""
    from hisparse.attention.gqa_indexer_reference import GqaIndexerFormat
    from hisparse.attention.sparse_gqa_reference import GqaRowFormat

    g = torch.Generator().manual_seed(11)
    n, h, kvh, d, bs, nb = 7, 6, 2, 32, 4, 9
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    rows_fmt = GqaRowFormat(kvh, d, name)
    key_fmt = GqaIndexerFormat("fp8", kvh, d)
    qkv = (torch.randn(n, (h + 2 * kvh) * d + 24, generator=g) * 3).to(dtype)
    qkv[2, h * d : (h + 1) * d] *= 400  # keys past 448: clamped
    qkv = qkv[:, : (h + 2 * kvh) * d]
    cos, sin = _angles(n, d // 2, dtype, g)
    pool = torch.randint(0, 256, (nb, 2, bs * rows_fmt.row_bytes), dtype=torch.uint8, generator=g)
    view = pool[:, 1].unflatten(1, (bs, rows_fmt.row_bytes))  # a layer of a shared pool
    pages = torch.randint(0, 256, (nb, 3, bs * key_fmt.row_bytes), dtype=torch.uint8, generator=g)
    pages = pages[:, 2]
    slots = torch.tensor([5, 30, -1, 12, 4, 35, 9])  # >= bs: block 0 is the null block
    key_slots = torch.tensor([7, -1, 33, 12, 4, 28, 21])
    (ref, ra), (got, ga) = reference_and_kernel(
        monkeypatch, fused.gqa_rope_write, qkv, h, cos, sin, view, slots, rows_fmt, pages,
        key_slots, key_fmt,
    )  # fmt: skip
    assert got.shape == (n, h, d) and torch.equal(ref, got)
    assert torch.equal(ra[4], ga[4]) and not torch.equal(ga[4], view)  # the K/V rows
    assert torch.equal(ra[7], ga[7]) and not torch.equal(ga[7], pages)  # the index keys


def test_empty_steps_launch_nothing(monkeypatch) -> None:
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    norm = _norm(64, torch.bfloat16, torch.Generator().manual_seed(0))
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    s, h = fused.add_rms_norm(norm, x, x)
    assert s.shape == h.shape == (0, 64)
    cs = torch.empty(0, 32, dtype=torch.bfloat16)
    assert fused.rope(torch.empty(0, 4, 64, dtype=torch.bfloat16), cs, cs, True).shape == (0, 4, 64)
    q, sc = fused.indexer_fp8_query(
        torch.empty(0, 4, 128, dtype=torch.bfloat16), cs, cs, 64, False, 128
    )
    assert q.shape == (0, 4, 128) and sc.shape == (0, 4, 1)


def test_inputs_the_kernels_do_not_take_fall_back(monkeypatch) -> None:
    """Mixed dtypes keep the reference's promotion (the kernels assume one dtype)."""
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    g = torch.Generator().manual_seed(2)
    norm = _norm(64, torch.bfloat16, g)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(3, 64, generator=g)  # fp32 residual: the sum is fp32
    s, _ = fused.add_rms_norm(norm, x, r)
    assert s.dtype == torch.float32
    cos, sin = _angles(3, 32, torch.float32, g)
    assert fused.rope(x.view(3, 1, 64), cos, sin, True).dtype == torch.float32


@triton.jit
def _e4m3_probe(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(o_ptr + i, ft._e4m3_bits(x).to(tl.uint8), mask=i < n)


def test_e4m3_encoding_equals_torch_at_every_boundary() -> None:
    """Every e4m3 value, the midpoints between neighbours (ties to even), a hair either side of
    them, subnormals, ±0 and ±448, against torch's cast."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    eps = mids.abs() * 2**-20 + 1e-12
    x = torch.cat([vals, mids, mids + eps, mids - eps, -vals, -mids, torch.tensor([-0.0])])
    x = x.clamp(-448, 448).contiguous()
    out = torch.full(x.shape, 0x55, dtype=torch.uint8)
    _e4m3_probe[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_ceil_pow2() -> None:
    k = torch.arange(-126, 120, dtype=torch.float32)
    p = torch.exp2(k)
    assert torch.equal(ceil_pow2(p), p)  # powers of two stay
    tiny = torch.tensor([1e-42, 2**-130])
    assert torch.equal(ceil_pow2(tiny), torch.full((2,), 2.0**-126))  # subnormals: the least normal
    above = torch.nextafter(p, torch.tensor(float("inf")))
    assert torch.equal(ceil_pow2(above[:-1]), p[1:])  # a hair above goes up one
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1000, generator=g) * 1e3 + 1e-3
    assert torch.equal(ceil_pow2(x), torch.exp2(torch.ceil(torch.log2(x.double()))).float())


@pytest.mark.parametrize("k,shared", [(2, 1), (6, 1), (2, 2)])
def test_batched_moe_equals_the_per_expert_loop(monkeypatch, k, shared) -> None:
    """The batched form adds the same rounded terms in the loop's order: equal in fp32 up to
    the matmuls' own rounding (their row counts differ). One shared expert of the routed
    experts' width rides in the stacks; two (twice as wide) run as their own MLP."""
    from hisparse.models.deepseek_v32 import MoE
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    torch.manual_seed(k + shared)
    kw = tiny_config_kwargs("deepseek_v32")
    kw.update(n_routed_experts=16, num_experts_per_tok=k, topk_group=4, n_shared_experts=shared)
    config = DsaConfig.from_dict({"model_type": "deepseek_v32", **kw})
    moe = MoE(config)
    for p in moe.parameters():
        p.data = torch.randn_like(p) * 0.2
    moe = moe.to(torch.bfloat16)
    moe.gate.float()
    x = torch.randn(11, config.hidden_size).to(torch.bfloat16)
    loop = moe(x, sync_free=True)
    moe.stack_experts()
    assert moe._stacked() and not moe.w_gate_up.requires_grad
    assert moe.shared_in_stack == (shared == 1)
    assert moe.w_gate_up.shape[0] == 16 + (shared == 1)
    assert (moe.shared_experts.gate_up is None) == (shared == 1)
    batched = moe(x, sync_free=True)
    torch.testing.assert_close(batched.float(), loop.float(), rtol=2**-7, atol=1e-3)
    monkeypatch.setenv("HISPARSE_FUSED", "reference")
    assert torch.equal(moe(x, sync_free=True), loop)  # the reference: the loop
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    moe.to(torch.float32)  # copies the experts apart: the stacks are dropped, the loop runs
    assert not moe._stacked() and moe.w_gate_up is None
    assert moe(x.float(), sync_free=True).shape == x.shape
    moe.stack_experts()
    moe.experts[-1].down_proj.weight = torch.nn.Parameter(torch.zeros_like(moe.w_down[-1]))
    assert not moe._stacked()  # a replaced expert weight is noticed


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_model_with_fused_ops_matches_the_references(monkeypatch, tiny_checkpoint, arch) -> None:
    """A DSA model (fp8 indexer, fp8_ds_mla rows, experts stacked): a prefill and two
    fixed-shape decode steps with every fused kernel against the torch references. In fp32:
    in bf16 an RMS norm's one-ulp difference (its sum order) can flip a router or top-k choice
    of this random model, which moves the output far (the ops' own tests cover bf16). The
    silu kernel's exp is numpy's here and an ulp from torch's (on CUDA both are ``expf``):
    torch's silu stands in for it (`test_silu_mul_matches_reference` checks the kernel)."""
    from hisparse.models.loader import load_dsa_model

    def torch_silu_mul(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]

    monkeypatch.setattr(ffn, "silu_mul", torch_silu_mul)

    model = load_dsa_model(tiny_checkpoint(arch), dtype=torch.float32, indexer_mode="fp8")
    model.prepare_fused()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (40, 23)]
    hidden = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("HISPARSE_FUSED", backend)
        cache = model.new_dense_cache(max_reqs=2, max_len=64, row_format="fp8_ds_mla")
        step = cache.begin_step([0, 1], [len(p) for p in prompts])
        out = [model(torch.cat(prompts), step, cache)]
        for t in range(2):
            step = cache.begin_step([0, 1], [1, 1])
            step.static = True
            out.append(model(torch.tensor([7 + t, 9 + t]), step, cache))
        hidden.append(out)
    for ref, got in zip(*hidden, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)  # an fp8 rounding apart
        logits = model.logits(ref), model.logits(got)
        assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("scores_in_kernel", [True, False])
@pytest.mark.parametrize(
    "e,groups,topk_group,k,norm",
    [(8, 4, 2, 2, True), (256, 8, 4, 8, True), (64, 1, 1, 6, False), (16, 16, 4, 1, True)],
)
def test_routing_kernel_chooses_the_references_experts(
    monkeypatch, e, groups, topk_group, k, norm, scores_in_kernel
) -> None:
    """The routing kernel from torch's scores, and with its own GEMV and sigmoid (the rows
    and the router weight in, `fused.ROUTE_ROWS_MAX_WEIGHTS`): the reference's choices, its
    weights to fp32's last bits."""
    from hisparse.models.deepseek_v32 import Router
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    if not scores_in_kernel:
        monkeypatch.setattr(fused, "ROUTE_ROWS_MAX_WEIGHTS", 0)
    calls: list[str] = []
    for name in ("route_dense", "route_dense_rows"):
        orig = getattr(ffn, name)
        monkeypatch.setattr(ffn, name, lambda *a, _o=orig, _n=name: calls.append(_n) or _o(*a))

    kw = tiny_config_kwargs("deepseek_v32")
    kw.update(n_routed_experts=e, n_group=groups, topk_group=topk_group)
    kw.update(num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = Router(DsaConfig.from_dict({"model_type": "deepseek_v32", **kw}))
    g = torch.Generator().manual_seed(e + k)
    router.weight.data = torch.randn(router.weight.shape, generator=g)
    router.e_score_correction_bias.data = torch.randn(e, generator=g) * 0.1
    x = torch.randn(37, kw["hidden_size"], generator=g).to(torch.bfloat16)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.route_dense, router, x)
    assert calls == ["route_dense_rows" if scores_in_kernel else "route_dense"]
    assert torch.equal(ref[1], got[1]) and int(got[1].sum()) == 37 * k
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [2, 8])
def test_moe_combine(monkeypatch, k) -> None:
    g = torch.Generator().manual_seed(k)
    e, n, h = 16, 9, 700
    y = (torch.randn(e, n, h, generator=g) * 3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.zeros(n, e).scatter_(1, ids, torch.rand(n, k, generator=g))
    chosen = torch.zeros(n, e, dtype=torch.bool).scatter_(1, ids, True)
    y[~chosen.t()] = float("nan")  # rows of experts a token did not choose are never read
    shared = torch.randn(n, h, generator=g).to(torch.bfloat16)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.moe_combine, y, w, chosen, shared)
    assert torch.equal(ref, got)  # the same roundings in the same order


def _tiny_llama():  # type: ignore[no-untyped-def]
    """A two-layer fp32 Llama with random weights, top_k 24 (prompts past it are scored)."""
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
    from hisparse.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, GqaIndexerConfig(top_k=24, recent_window=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_llama_with_fused_ops_matches_the_references(monkeypatch) -> None:
    """A Llama (GQA) model after `prepare_fused` (stacked q, k, v and gate, up weights, the
    rotary table): a prefill and fixed-shape decode steps with the fused ops (add + norm,
    rotary, silu · up) against the torch references, fp32. torch's silu stands in for the
    kernel's numpy exp, as in the DSA test above."""

    def torch_silu_mul(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]

    monkeypatch.setattr(ffn, "silu_mul", torch_silu_mul)
    model = _tiny_llama()
    ptr = model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    model.prepare_fused()
    attn = model.model.layers[0].self_attn
    assert attn._qkv is not None and attn.q_proj.weight.data_ptr() == attn._qkv[0].data_ptr()
    assert attn.q_proj.weight.data_ptr() != ptr and model.rotary.table is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (40, 23)]
    hidden = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("HISPARSE_FUSED", backend)
        cache = model.new_dense_cache(max_reqs=2, max_len=64, block_size=8)
        step = cache.begin_step([0, 1], [len(p) for p in prompts])
        out = [model(torch.cat(prompts), step, cache)]
        for t in range(3):
            step = cache.begin_step([0, 1], [1, 1])
            step.static, step.max_len = True, 64
            out.append(model(torch.tensor([7 + t, 9 + t]), step, cache))
        hidden.append(out)
    for ref, got in zip(*hidden, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_llama_prefill_by_token_rows_matches_the_batched_path(monkeypatch) -> None:
    """A multi-token step on CUDA takes the decode kernels with one row per token (the
    Triton indexer and sparse GQA attention): the same selections as the batched prefill
    path, and the same hidden states up to fp32 summation order, over a first chunk (one
    request scored, one short enough to be dense) and a second chunk on top of it; the
    tokens in one block and in blocks of about ten (`PREFILL_SCRATCH_BYTES`)."""
    from hisparse.models import llama_attention

    model = _tiny_llama()
    picks: list[torch.Tensor] = []
    select = llama_attention.LlamaAttention._select

    def recording(self, *args):  # type: ignore[no-untyped-def]
        out = select(self, *args)
        picks.append(out.clone())
        return out

    monkeypatch.setattr(llama_attention.LlamaAttention, "_select", recording)
    g = torch.Generator().manual_seed(1)
    chunks = [[torch.randint(0, 96, (n,), generator=g) for n in ns] for ns in ((40, 23), (9, 5))]
    runs = []
    for backend, scratch in (("reference", None), ("triton", None), ("triton", 4 * 5 * 64 * 8)):
        monkeypatch.setenv("HISPARSE_GQA_INDEXER", backend)
        monkeypatch.setenv("HISPARSE_ATTENTION", backend)
        if scratch is not None:  # blocks of 10-12 tokens
            monkeypatch.setattr(llama_attention, "PREFILL_SCRATCH_BYTES", scratch)
        picks.clear()
        cache = model.new_dense_cache(max_reqs=2, max_len=64, block_size=8)
        hidden = []
        for chunk in chunks:
            step = cache.begin_step([0, 1], [len(c) for c in chunk])
            hidden.append(model(torch.cat(chunk), step, cache))
        runs.append((hidden, list(picks)))
    (ref_h, ref_k), *kernel_runs = runs
    assert (ref_k[2] >= 0).sum(1).max() == 24  # the second chunk selects top_k rows
    for got_h, got_k in kernel_runs:  # in one block of tokens, then in small blocks
        assert len(ref_k) == len(got_k) == 4  # two layers, two chunks
        for ref, got in zip(ref_k, got_k, strict=True):
            assert torch.equal(ref, got)
        for ref, got in zip(ref_h, got_h, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_prefill_keeps_the_batched_path_for_shapes_the_kernels_decline(monkeypatch) -> None:
    """A head dim that is not a power of two: the decode kernels decline it, so a multi-token
    step keeps the batched path (not their per-token references); a power of two takes the
    kernels, and ``reference`` keeps the batched path for any shape."""
    from hisparse.attention import dispatch
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat
    from hisparse.attention.sparse_gqa_reference import GqaRowFormat

    cfg = GqaIndexerConfig(top_k=24, recent_window=8)
    for d, backend, want in ((16, "triton", True), (24, "triton", False), (16, "reference", False)):
        monkeypatch.setenv("HISPARSE_ATTENTION", backend)
        monkeypatch.setenv("HISPARSE_GQA_INDEXER", backend)
        rows, keys = GqaRowFormat(2, d), GqaIndexerFormat("fp8", 2, d)
        q = torch.zeros(5, 4, d)
        view = torch.zeros(3, 8, rows.row_bytes, dtype=torch.uint8)
        pages = torch.zeros(3, 8 * keys.row_bytes, dtype=torch.uint8)
        table = torch.zeros(2, 3, dtype=torch.int32)
        assert dispatch.sparse_gqa_kernel_takes(q, view, rows) is want
        assert dispatch.gqa_indexer_kernel_takes(q, pages, table, keys, cfg) is want
