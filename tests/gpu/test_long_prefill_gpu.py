"""Long prompts through the real prefill on CUDA, on the architecture's real attention and
indexer shapes (the ``v32-attention`` preset: fp8_ds_mla rows, the Triton sparse MLA and
indexer kernels): a 128K-token prompt in chunks and a 64K-token prompt in one chunk give the
same greedy tokens in both placements with CUDA graphs on, and running requests keep decoding
while a long prompt prefills.

Checkpoint: ``HISPARSE_V32_DIR`` (a ``make_tiny(..., preset="v32-attention")`` folder), else
written here (transformers builds it on the CPU: about a minute).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LONG = 131072


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    base = os.environ.get("HISPARSE_V32_DIR")
    if base and (Path(base) / "config.json").is_file():
        return Path(base)
    from hisparse.models.tiny import make_tiny

    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("v32"), preset="v32-attention")


def _generate(checkpoint, placement, prompts, params, *, chunk, **kw):
    with LLM(
        checkpoint,
        kv_placement=placement,
        device="cuda",
        max_model_len=LONG + 64,
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        gpu_memory_gib=4,
        cuda_graphs=True,
        hisparse=HiSparseConfig(host_pool_gib=4, offload="always"),  # read via the hot buffer
        **kw,
    ) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        steps = [(bool(s["decode"]), int(s["tokens"])) for s in llm.step_stats]
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], outs, steps


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (n,), generator=g).tolist()


@pytest.mark.parametrize(("length", "chunk"), [(LONG, 16384), (65536, 65536)])
def test_long_real_prefill_same_tokens_in_both_placements(checkpoint, length, chunk):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [_prompt(length, seed=1)]
    tokens = {}
    for placement in ("gpu", "hisparse"):
        tokens[placement], outs, steps = _generate(
            checkpoint, placement, prompts, params, chunk=chunk
        )
        assert [n for d, n in steps if not d] == [chunk] * (length // chunk)
        assert len(tokens[placement][0]) == 8
        if placement == "hisparse":
            assert outs[0].metrics.hits > 0
    assert tokens["hisparse"] == tokens["gpu"]


def test_running_requests_decode_while_a_long_prompt_prefills(checkpoint):
    """Mixed schedule: the short requests' decode steps interleave with the long prompt's
    chunks (HiSparse == all-GPU under that schedule); prefill-first runs the chunks alone."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [_prompt(300, seed=2), _prompt(500, seed=3), _prompt(40000, seed=4)]
    runs = {}
    for schedule in ("mixed", "prefill-first"):
        for placement in ("gpu", "hisparse"):
            tokens, _, steps = _generate(
                checkpoint, placement, prompts, params, chunk=8192, schedule=schedule
            )
            runs[schedule, placement] = tokens
            first_decode = next(i for i, (d, _) in enumerate(steps) if d)
            last_prefill = max(i for i, (d, _) in enumerate(steps) if not d)
            assert (first_decode < last_prefill) == (schedule == "mixed"), steps
        assert runs[schedule, "hisparse"] == runs[schedule, "gpu"]
