"""DeepSeek-V4 on CUDA: the attention kernel at V4-Flash shapes against its reference, and the
engine's decode through a captured CUDA graph against the fixed-shape step run eagerly.

Runs on the GPU machine only (``pytest tests/gpu``; CI ignores it). The kernel: 64 heads of
512, a 128-row window and 512 (CSA) or 1024 (HCA at 128K) entries, batches 1 and 32, bf16
and fp32, split counts of the kernel's choice and forced; the reference runs in fp32 on the
same GPU. The engine: a tiny V4 checkpoint (`v4_tiny`) with ``cuda_graphs=True`` gives the
greedy tokens of ``cuda_graphs=False``, and HiSparse placement the all-GPU placement's (eager
and in graphs, both offload policies).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs CUDA", allow_module_level=True)

from hisparse.attention.v4_attention_reference import v4_attention_paged_reference
from hisparse.attention.v4_attention_triton import v4_attention_triton

DEV = torch.device("cuda")
H, D, W, BS = 64, 512, 128, 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("entries", [512, 1024])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_kernel_equals_reference(dtype, batch, entries, splits):
    g = torch.Generator(device=DEV).manual_seed(batch + entries)
    blocks = 256
    pool = torch.randn(blocks, BS, 2 * D + 128, generator=g, device=DEV).to(dtype)
    q = torch.randn(batch, H, D, generator=g, device=DEV).to(dtype)
    idx = torch.randint(0, blocks * BS, (batch, W + entries), generator=g, device=DEV,
                        dtype=torch.int32)  # fmt: skip
    idx[torch.rand(idx.shape, generator=g, device=DEV) < 0.2] = -1
    sinks = torch.randn(H, generator=g, device=DEV)
    args = (idx, W, D, sinks, D**-0.5)
    want = v4_attention_paged_reference(q.float(), pool.float(), *args)
    out = torch.full_like(q, float("nan"))
    got = v4_attention_triton(q, pool, *args, out=out, num_splits=splits)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_engine_graphs_equal_eager(tmp_path):
    from hisparse import LLM, SamplingParams
    from hisparse.models.v4_tiny import make_tiny_v4

    ckpt = make_tiny_v4(tmp_path / "v4", "tiny")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (40, 17, 90)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = []
    for graphs in (False, True):
        with LLM(ckpt, kv_placement="gpu", cuda_graphs=graphs, max_num_seqs=4, dtype="float32",
                 max_model_len=256, gpu_memory_gib=0.5) as llm:  # fmt: skip
            assert llm.runner.decode_path == ("graphs" if graphs else "eager")
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("offload", ["always", "under_pressure"])
def test_engine_hisparse_equals_all_gpu(tmp_path, graphs, offload):
    """HiSparse placement (design §20.2) on CUDA: the entries from the pinned host pool
    through the hot buffers (copy stream, UVA gathers), eager and in captured CUDA graphs,
    give the all-GPU placement's greedy tokens; with ``"always"`` the hot buffers are used."""
    from hisparse import LLM, HiSparseConfig, SamplingParams
    from hisparse.models.v4_tiny import make_tiny_v4

    ckpt = make_tiny_v4(tmp_path / "v4", "tiny")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (140, 37, 90)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens, misses = [], 0
    for placement in ("gpu", "hisparse"):
        with LLM(ckpt, kv_placement=placement, cuda_graphs=graphs, max_num_seqs=4,
                 dtype="float32", max_model_len=256, gpu_memory_gib=0.5,
                 max_num_batched_tokens=64,
                 hisparse=HiSparseConfig(block_size=16, offload=offload)) as llm:  # fmt: skip
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        tokens.append([o.outputs[0].token_ids for o in outs])
        if placement == "hisparse":
            misses = sum(o.metrics.misses for o in outs)
    assert tokens[0] == tokens[1]
    assert (misses > 0) == (offload == "always")
