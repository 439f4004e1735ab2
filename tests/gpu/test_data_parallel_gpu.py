"""Data-parallel attention with expert parallelism on 2 GPUs (NCCL: the agreement all-reduce,
the MoE's all-gathers and reduce-scatter on the device; pinned host pools per rank): the same
greedy tokens as one GPU (docs/design.md §21). Written on a CPU machine; not run on GPUs yet.

    python3 -m pytest -o addopts="" -q tests/gpu/test_data_parallel_gpu.py

Checkpoints: ``HISPARSE_TINY_DIR`` (written on a CPU machine by `make_tiny`), else written here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory) -> Path:
    base = os.environ.get("HISPARSE_TINY_DIR")
    if base and (Path(base) / request.param / "config.json").is_file():
        return Path(base) / request.param
    from hisparse.models.tiny import make_tiny

    out = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, out, seed=0)
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    from hisparse.models.tiny import make_tiny

    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("v32-fp8"), fp8=True)


def _generate(path: Path, dp: int, placement: str, dtype: str = "float32") -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70, 33)]
    with LLM(
        path,
        kv_placement=placement,
        device="cuda",
        dtype=dtype,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload="always"),
        kv_format="bf16",
        max_model_len=256,
        gpu_memory_gib=0.05,
        data_parallel_size=dp,
        enable_expert_parallel=dp > 1,
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=32)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        if dp > 1:
            assert min(llm._core.assigned) > 0
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("placement", ["hisparse", "gpu"])
def test_dp2_ep2_equals_one_gpu(checkpoint, placement):
    assert _generate(checkpoint, 2, placement) == _generate(checkpoint, 1, placement)


def test_dp2_ep2_fp8_grouped_experts(fp8_checkpoint):
    """The grouped fp8 expert kernels with each rank's slice of the experts (other ranks'
    pairs at weight 0 on local expert 0)."""
    assert _generate(fp8_checkpoint, 2, "hisparse", "bfloat16") == _generate(
        fp8_checkpoint, 1, "hisparse", "bfloat16"
    )
