"""Speculative verify steps in CUDA graphs (`engine.static_verify`): on tiny DSA checkpoints,
drafts forced all taken and all refused, a run whose verify steps replay captured (k + 1)-row
graphs gives the tokens of the same run with eager verify steps and of the run without
speculation, in both placements (HiSparse with ``offload="always"``: every older row read
through the hot buffer the rows share). What it checks: graph replay == eager for k + 1 rows
per request (three requests padded to four; rows past a request's drafts are padding).

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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory) -> Path:
    base = os.environ.get("HISPARSE_TINY_DIR")
    if base and (Path(base) / request.param / "config.json").is_file():
        return Path(base) / request.param
    from hisparse.models.tiny import make_tiny

    out = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, out, seed=0)
    return out


class Forced:
    """Drafts from the plain run's continuation (all taken) or one off it (all refused)."""

    def __init__(self, prompts, outputs, accept: bool) -> None:
        self.known, self.accept = list(zip(prompts, outputs, strict=True)), accept

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, out in self.known:
            if tokens[: len(prompt)] == prompt:
                nxt = out[len(tokens) - len(prompt) :][:k]
                return nxt if self.accept else [(t + 1) % 512 for t in nxt]
        raise AssertionError("an unknown request")


def _run(checkpoint, placement, prompts, *, graphs, spec=None, forced=None):
    with LLM(
        checkpoint, kv_placement=placement, device="cuda", dtype="float32", kv_format="bf16",
        max_model_len=256, max_num_seqs=4, gpu_memory_gib=0.05, cuda_graphs=graphs,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload="always"),
        speculative_config=spec,
    ) as llm:  # fmt: skip
        if forced is not None:
            llm.scheduler.proposer = forced
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        vg = llm.runner.verify_graphs
        captured = sorted(vg.graphs) if vg is not None and vg.capture else []
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], outs, captured


@pytest.mark.parametrize("placement", ["gpu", "hisparse"])
def test_verify_graphs_replay_equals_eager(checkpoint, placement):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 512, (n,), generator=g).tolist() for n in (40, 23, 70)]
    want, _, _ = _run(checkpoint, placement, prompts, graphs=True)
    for accept in (True, False):
        got = {}
        for graphs in (True, False):
            forced = Forced(prompts, want, accept)
            got[graphs], outs, captured = _run(
                checkpoint, placement, prompts, graphs=graphs, spec=SPEC, forced=forced
            )
            drafted = sum(o.metrics.spec_drafted for o in outs)
            accepted = sum(o.metrics.spec_accepted for o in outs)
            assert drafted > 0 and accepted == (drafted if accept else 0)
            if graphs:
                assert captured, "no verify graph was captured"
        assert got[True] == got[False] == want, accept
