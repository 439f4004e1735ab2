"""MTP speculative decoding on CUDA (`engine.mtp_drafts`; an MTP engine decodes eagerly): on
tiny DSA checkpoints with an MTP layer, greedy tokens with MTP drafts equal the run without
speculation (CUDA graphs on), in both placements and both offload policies (with
``under_pressure`` the pool has room, so CUDA decode steps take the all-resident lookups),
with the MTP layer's own drafts and with them replaced by the continuation (all taken); the
drafts are the dense reference's, or differ at a near-tie of its logits (margin logged).
The pools are empty after.

Checkpoints: written here (`make_tiny(mtp=True)` goes through `checkpoint_writer`, no
transformers needed).
"""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.testing.mtp import check_drafts, watch_drafts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    from hisparse.models.tiny import make_tiny

    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), mtp=True)


def _run(checkpoint, placement, offload, prompts, *, spec=None, seen=None, accept=None):
    with LLM(
        checkpoint, kv_placement=placement, device="cuda", dtype="float32", kv_format="bf16",
        max_model_len=256, max_num_seqs=4, gpu_memory_gib=0.05,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload=offload),
        speculative_config=spec,
    ) as llm:  # fmt: skip
        if spec is not None:
            watch_drafts(llm, seen, accept, prompts)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        kv = llm.kv
        assert not kv.requests and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        assert kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
        model = llm.model
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], outs, model


@pytest.mark.parametrize(
    "placement,offload",
    [("gpu", "under_pressure"), ("hisparse", "under_pressure"), ("hisparse", "always")],
)
def test_mtp_on_cuda_gives_the_plain_tokens(checkpoint, placement, offload):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 250, (n,), generator=g).tolist() for n in (40, 23, 70)]
    want, _, _ = _run(checkpoint, placement, offload, prompts)
    for accept in (None, want):
        seen: list = []
        got, outs, model = _run(checkpoint, placement, offload, prompts, spec=MTP, seen=seen,
                                accept=accept)  # fmt: skip
        assert got == want, accept is None
        m = [o.metrics for o in outs]
        assert sum(x.spec_drafted for x in m) > 0
        if accept is not None:
            assert all(x.spec_accepted == x.spec_drafted for x in m)
        margins = check_drafts(model, seen, tie=1e-3)
        print(f"{placement}/{offload}: {len(seen)} drafts checked, near-ties {margins}")
