"""The fused layer kernels on CUDA against their torch references on CUDA, at DeepSeek-V3.2's
dimensions and the engine's sizes (a decode batch and a prefill chunk of 8192 tokens):
rotary and the indexer's queries and keys bit-exact, the MLA rows and the RMS norm within an
ulp of the norm (its sum order), poisoned pages compared whole; then the batched MoE against
the loop and a CUDA graph replay. Runs on the GPU machine only (CI ignores ``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from hisparse.kv.row_formats import IndexerCacheFormat, mla_row_bytes
from hisparse.models import fused
from hisparse.models.layers import RMSNorm
from hisparse.testing.fused_cases import (
    assert_indexer_keys_close,
    assert_mla_rows_match,
    reference_and_kernel,
)

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _g(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _angles(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(n, 32, generator=g, device=DEV) * 1e4
    return a.cos().to(BF16), a.sin().to(BF16)


@pytest.mark.parametrize("n", [1, 29, 8192])
@pytest.mark.parametrize("d", [512, 1536, 7168])
def test_rms_norm(monkeypatch, n: int, d: int) -> None:
    g = _g(n + d)
    x = (torch.randn(n, d + 64, generator=g, device=DEV) * 3).to(BF16)[:, :d]
    r = (torch.randn(n, d, generator=g, device=DEV) * 3).to(BF16)
    norm = RMSNorm(d, 1e-6).to(DEV)
    norm.weight.data = (torch.randn(d, generator=g, device=DEV) * 0.3 + 1).to(BF16)
    for res in (None, r):
        (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.add_rms_norm, norm, x, res)
        assert torch.equal(ref[0], got[0])
        torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2**-6, atol=1e-6)
        assert (got[1] != ref[1]).float().mean() < 0.01


@pytest.mark.parametrize("n", [1, 29, 8192])
def test_rope_and_indexer_queries_bit_exact(monkeypatch, n: int) -> None:
    g = _g(n)
    cos, sin = _angles(n, g)
    q_pe = (torch.randn(n, 128, 192, generator=g, device=DEV) * 4).to(BF16)[..., 128:]
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.rope, q_pe, cos, sin, True)
    assert torch.equal(ref, got)
    q = torch.randn(n, 64, 128, generator=g, device=DEV)
    q = (q * 10.0 ** torch.randint(-3, 3, (n, 64, 1), generator=g, device=DEV)).to(BF16)
    # The same queries as the tail of stacked projection rows (q_b_proj's 128 x 192 first).
    rows = torch.randn(n, 128 * 192 + 64 * 128, generator=g, device=DEV).to(BF16)
    rows[:, 128 * 192 :] = q.reshape(n, -1)
    strided = rows[:, 128 * 192 :].view(n, 64, 128)
    for interleaved, queries in ((False, q), (True, q), (True, strided)):
        (ref, _), (got, _) = reference_and_kernel(
            monkeypatch, fused.indexer_fp8_query, queries, cos, sin, 64, interleaved, 128
        )
        assert torch.equal(ref[0].view(torch.uint8), got[0].view(torch.uint8))
        assert torch.equal(ref[1], got[1])


@pytest.mark.parametrize("n", [1, 29, 8192])
def test_indexer_keys_and_mla_rows_into_poisoned_pages(monkeypatch, n: int) -> None:
    g = _g(n + 1)
    bs, nb = 64, n // 64 + 8
    cos, sin = _angles(n, g)
    # Block 0 is the engine's null block: the reference rewrites its row 0 for skipped slots.
    slots = bs + torch.randperm((nb - 1) * bs, generator=g, device=DEV)[:n]
    slots[::7] = -1
    fmt = IndexerCacheFormat.for_mode("fp8", 128)
    pages = torch.randint(0, 256, (nb, bs * fmt.row_bytes), generator=g, device=DEV)
    pages = pages.to(torch.uint8)
    k = (torch.randn(n, 128, generator=g, device=DEV) * 2).to(BF16)
    (_, ref), (_, got) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_write_keys, k, cos, sin, 64, False, pages, fmt, slots
    )
    assert torch.equal(ref[5], got[5])
    norm = RMSNorm(512, 1e-6).to(DEV)
    norm.weight.data = (torch.randn(512, generator=g, device=DEV) * 0.3 + 1).to(BF16)
    kv = (torch.randn(n, 576 + 1536, generator=g, device=DEV) * 4).to(BF16)[:, :576]
    for name in ("fp8_ds_mla", "bf16"):
        rb = mla_row_bytes(name, 512, 64)
        view = torch.randint(0, 256, (nb, bs, rb), generator=g, device=DEV).to(torch.uint8)
        (_, ref), (_, got) = reference_and_kernel(
            monkeypatch, fused.write_mla_rows, kv, norm, cos, sin, view, slots, name
        )
        assert_mla_rows_match(ref[4], got[4], view, slots, name)


def test_fused_ops_replay_in_a_cuda_graph(monkeypatch) -> None:
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    g = _g(3)
    n = 29
    x = (torch.randn(n, 7168, generator=g, device=DEV)).to(BF16)
    r = torch.randn_like(x)
    norm = RMSNorm(7168, 1e-6).to(DEV).to(BF16)
    cos, sin = _angles(n, g)
    q = torch.randn(n, 64, 128, generator=g, device=DEV).to(BF16)
    fused.add_rms_norm(norm, x, r)
    fused.indexer_fp8_query(q, cos, sin, 64, False, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, h = fused.add_rms_norm(norm, x, r)
        qf, qs = fused.indexer_fp8_query(q, cos, sin, 64, False, 128)
    x.copy_(torch.randn_like(x))
    q.copy_(torch.randn_like(q))
    graph.replay()
    s2, h2 = fused.add_rms_norm(norm, x, r)
    qf2, qs2 = fused.indexer_fp8_query(q, cos, sin, 64, False, 128)
    assert torch.equal(s, s2) and torch.equal(h, h2)
    assert torch.equal(qf.view(torch.uint8), qf2.view(torch.uint8)) and torch.equal(qs, qs2)


def test_batched_moe_at_v32_width(monkeypatch) -> None:
    from hisparse.models.deepseek_v32 import MoE
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    torch.manual_seed(0)
    cfg = tiny_config_kwargs("deepseek_v32", "v32-attention")
    config = DsaConfig.from_dict({"model_type": "deepseek_v32", **cfg})
    moe = MoE(config).to(DEV)
    for p in moe.parameters():
        p.data = torch.randn_like(p) * 0.02
    moe = moe.to(BF16)
    moe.gate.float()
    x = torch.randn(29, config.hidden_size, device=DEV).to(BF16)
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    loop = moe(x, sync_free=True)
    moe.stack_experts()
    assert moe.shared_in_stack  # one shared expert: the stacks' last entry
    batched = moe(x, sync_free=True)
    torch.testing.assert_close(batched.float(), loop.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("n", [1, 29, 2048])
def test_routing_with_the_kernels_own_scores(monkeypatch, arch: str, n: int) -> None:
    """The benchmark presets' router (8 experts over the real hidden width): the kernel's
    own fp32 GEMV and sigmoid against torch's, up to a prefill step's rows."""
    from hisparse.models.deepseek_v32 import Router
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    kw = tiny_config_kwargs(arch, "v32-attention")
    router = Router(DsaConfig.from_dict({"model_type": arch, **kw})).to(DEV)
    assert router.weight.numel() <= fused.ROUTE_ROWS_MAX_WEIGHTS
    g = _g(n + 5)
    router.weight.data = torch.randn(router.weight.shape, generator=g, device=DEV) * 0.02
    router.e_score_correction_bias.data = torch.randn(8, generator=g, device=DEV) * 0.1
    x = torch.randn(n, kw["hidden_size"], generator=g, device=DEV).to(BF16)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.route_dense, router, x)
    assert torch.equal(ref[1], got[1])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)  # the GEMV's sum order


def test_routing_and_combine_at_deepseek_width(monkeypatch) -> None:
    """256 experts in 8 groups, 8 per token (DeepSeek-V3.2's router) on 64 rows."""
    from hisparse.models.deepseek_v32 import Router
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    kw = tiny_config_kwargs("deepseek_v32", "v32-attention")
    kw.update(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8)
    router = Router(DsaConfig.from_dict({"model_type": "deepseek_v32", **kw})).to(DEV)
    g = _g(11)
    router.weight.data = torch.randn(router.weight.shape, generator=g, device=DEV) * 0.02
    router.e_score_correction_bias.data = torch.randn(256, generator=g, device=DEV) * 0.1
    x = torch.randn(64, kw["hidden_size"], generator=g, device=DEV).to(BF16)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.route_dense, router, x)
    assert torch.equal(ref[1], got[1])  # torch's sigmoid feeds both: the same choices
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)  # the norm's sum order
    y = torch.randn(256, 64, 7168, generator=g, device=DEV).to(BF16)
    shared = torch.randn(64, 7168, generator=g, device=DEV).to(BF16)
    (ref, _), (got, _) = reference_and_kernel(
        monkeypatch, fused.moe_combine, y, got[0], got[1], shared
    )
    assert torch.equal(ref, got)  # the loop's roundings in the loop's order


@pytest.mark.parametrize("n", [1, 29, 8192])
def test_indexer_keys_with_their_layer_norm(monkeypatch, n: int) -> None:
    g = _g(n + 2)
    bs, nb = 64, n // 64 + 8
    cos, sin = _angles(n, g)
    slots = bs + torch.randperm((nb - 1) * bs, generator=g, device=DEV)[:n]
    slots[::5] = -1
    fmt = IndexerCacheFormat.for_mode("fp8", 128)
    pages = torch.randint(0, 256, (nb, bs * fmt.row_bytes), generator=g, device=DEV)
    pages = pages.to(torch.uint8)
    k = (torch.randn(n, 2240, generator=g, device=DEV) * 2).to(BF16)[:, 2112:]  # a_proj's split
    norm = torch.nn.LayerNorm(128, eps=1e-6).to(DEV)
    norm.weight.data = torch.randn(128, generator=g, device=DEV) * 0.3 + 1
    norm.bias.data = torch.randn(128, generator=g, device=DEV) * 0.1
    norm = norm.to(BF16)
    (_, ref), (_, got) = reference_and_kernel(
        monkeypatch, fused.indexer_fp8_write_keys, k, cos, sin, 64, False, pages, fmt, slots,
        norm,
    )  # fmt: skip
    assert_indexer_keys_close(ref[5], got[5], pages, fmt, slots)


@pytest.mark.parametrize("shape", [(1, 2048), (29, 2048), (8192, 2048), (8, 29, 512)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_silu_mul_bit_exact(monkeypatch, shape, dtype) -> None:
    """libdevice's expf in the kernel, as in torch's silu: the same bits."""
    x = (torch.randn(*shape, generator=_g(shape[0]), device=DEV) * 4).to(dtype)
    (ref, _), (got, _) = reference_and_kernel(monkeypatch, fused.silu_mul, x)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("n", [1, 64, 8192])
def test_gqa_rope_write_bit_exact(monkeypatch, n: int) -> None:
    """SmolLM2's dimensions (9 q heads, 3 KV heads of 64): q, the K/V rows of a layer strided
    in a shared pool and the e4m3 keys, poisoned pages compared whole."""
    from hisparse.attention.gqa_indexer_reference import GqaIndexerFormat
    from hisparse.attention.sparse_gqa_reference import GqaRowFormat

    g = _g(n + 7)
    h, kvh, d, bs = 9, 3, 64, 16
    nb = n // bs + 8
    rows_fmt, key_fmt = GqaRowFormat(kvh, d, "bf16"), GqaIndexerFormat("fp8", kvh, d)
    qkv = (torch.randn(n, (h + 2 * kvh) * d, generator=g, device=DEV) * 3).to(BF16)
    qkv[::5, h * d : (h + 1) * d] *= 300  # keys past 448: clamped
    a = torch.rand(n, d // 2, generator=g, device=DEV) * 1e4
    cos, sin = a.cos().to(BF16), a.sin().to(BF16)
    pool = torch.randint(0, 256, (nb, 2, bs * rows_fmt.row_bytes), generator=g, device=DEV)
    view = pool.to(torch.uint8)[:, 1].unflatten(1, (bs, rows_fmt.row_bytes))
    pages = torch.randint(0, 256, (nb, bs * key_fmt.row_bytes), generator=g, device=DEV)
    pages = pages.to(torch.uint8)
    slots = bs + torch.randperm((nb - 1) * bs, generator=g, device=DEV)[:n]
    key_slots = bs + torch.randperm((nb - 1) * bs, generator=g, device=DEV)[:n]
    slots[::7], key_slots[::5] = -1, -1
    (ref, ra), (got, ga) = reference_and_kernel(
        monkeypatch, fused.gqa_rope_write, qkv, h, cos, sin, view, slots, rows_fmt, pages,
        key_slots, key_fmt,
    )  # fmt: skip
    assert torch.equal(ref, got)
    assert torch.equal(ra[4], ga[4]) and torch.equal(ra[7], ga[7])


@pytest.mark.parametrize("n", [1, 29, 64, 65])
def test_indexer_head_weights(monkeypatch, n: int) -> None:
    g = _g(n + 3)
    proj = torch.nn.Linear(7168, 64, bias=False).to(DEV)
    proj.weight.data = torch.randn(64, 7168, generator=g, device=DEV) * 0.02
    x = torch.randn(n, 7168 + 64, generator=g, device=DEV).to(BF16)[:, :7168]
    (ref, _), (got, _) = reference_and_kernel(
        monkeypatch, fused.indexer_head_weights, proj, x, 0.125
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_rotary_table_holds_the_direct_angles() -> None:
    from hisparse.models.deepseek_v32 import Rotary
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    cfg = DsaConfig.from_dict(
        {"model_type": "deepseek_v32", **tiny_config_kwargs("deepseek_v32", "v32-attention")}
    )
    rot = Rotary(cfg).to(DEV)
    rot.build_table(cfg.max_position_embeddings, BF16, DEV)
    pos = torch.randint(0, cfg.max_position_embeddings, (4096,), generator=_g(9), device=DEV)
    cos, sin = rot(pos, BF16, cfg.max_position_embeddings)
    want = rot.angles(pos, BF16)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


@pytest.mark.parametrize("b", [1, 29, 64])
def test_decode_inputs_and_resident_rows(monkeypatch, b: int) -> None:
    """The decode step's inputs (one kernel) and the all-GPU lookup (one kernel) against
    their torch compositions at 128K tables (2,048 blocks of 64), top-k 2,048."""
    from hisparse.engine.decode_inputs import decode_inputs, decode_inputs_reference
    from hisparse.runtime.ops import reference as ops_ref
    from hisparse.runtime.ops import triton_backend as ops_tk

    g = _g(b + 5)
    slots, bs, mb = b + 3, 64, 2048
    table = torch.randint(1, 90000, (3, slots + 1, mb), generator=g, device=DEV)
    table = table.to(torch.int32)
    pos = torch.randint(0, mb * bs, (b,), generator=g, device=DEV)
    slot = torch.randperm(slots, generator=g, device=DEV)[:b]
    slot[1::3] = -1
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    got = decode_inputs(pos, slot, table, bs, slots)
    want = decode_inputs_reference(pos, slot, table, bs, slots)
    for name in want.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    topk = torch.randint(-1, mb * bs, (b, 2048), generator=g, device=DEV).to(torch.int32)
    outs = []
    for fn in (ops_ref.resident_rows, ops_tk.resident_rows):
        phys = torch.full((b + 2, 2048), -7, dtype=torch.int32, device=DEV)
        valid = torch.full((b + 2,), -7, dtype=torch.int32, device=DEV)
        fn(topk, want.req_index_i32, table[0], bs, phys, valid)
        outs.append((phys, valid))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
