"""Prompts longer than one prefill step, end to end on the CPU (tiny DSA checkpoints and the
bundled SmolLM2): a prompt prefilled in chunks gives the greedy tokens of the same prompt in
one step, in both placements (HiSparse == all-GPU), and a short request batched beside a long
one gets the tokens it gets alone, whichever schedule runs the two (decodes mixed with prompt
chunks, or prompt chunks first)."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
#: A prompt past the default prefill step of 2,048 tokens: 2 steps of 2,048, 5 of 512.
LONG = 2200


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def _llm(path, placement, *, chunk, max_model_len=4096, offload=None, **kw):
    return LLM(
        path,
        kv_placement=placement,
        kv_format="bf16",
        max_model_len=max_model_len,
        max_num_batched_tokens=chunk,
        gpu_memory_gib=0.05,
        hisparse=HiSparseConfig(host_pool_gib=0.05, block_size=16, offload=offload),
        **kw,
    )


def _generate(path, placement, prompts, *, chunk, params=GREEDY, **kw):
    with _llm(path, placement, chunk=chunk, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        steps = [(row["decode"], row["tokens"]) for row in llm.step_stats]
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], steps


def _prompt(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def test_a_prompt_past_the_prefill_step_in_chunks_equals_one_step(checkpoint):
    prompt = [_prompt(LONG)]
    one, steps = _generate(checkpoint, "gpu", prompt, chunk=4096)
    assert steps[0] == (0.0, LONG)  # the whole prompt in one forward
    for chunk in (512, 2048):
        for placement in ("gpu", "hisparse"):
            got, steps = _generate(checkpoint, placement, prompt, chunk=chunk)
            prefill = [n for decode, n in steps if not decode]
            assert prefill == [chunk] * (LONG // chunk) + [LONG % chunk], prefill
            assert got == one, (chunk, placement)


@pytest.mark.parametrize("schedule", ["mixed", "prefill-first"])
def test_a_short_request_beside_a_long_one_gets_its_tokens_alone(checkpoint, schedule):
    short, long = _prompt(40, seed=5), _prompt(1300, seed=6)  # 3 chunks of at most 512
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone, _ = _generate(checkpoint, "gpu", [short], chunk=512, params=params)
    for placement in ("gpu", "hisparse"):
        both, steps = _generate(
            checkpoint, placement, [short, long], chunk=512, params=params, schedule=schedule
        )
        assert both[0] == alone[0], (placement, schedule)
        # the short request decodes while the long prompt is still being chunked (mixed),
        # or only after it (prefill-first)
        first_decode = next(i for i, (d, _) in enumerate(steps) if d)
        last_prefill = max(i for i, (d, _) in enumerate(steps) if not d)
        assert (first_decode < last_prefill) == (schedule == "mixed"), steps


def test_a_long_prefill_holds_at_most_the_plans_blocks_at_every_step(checkpoint):
    """A HiSparse prefill streams its pages to the host as its chunks finish: at every step
    (its peak, while the forward runs) a request holds at most what the planner counts for it
    (`KVLayout.gpu_blocks_per_request`, which admission and preemption use too), at most
    three resident pages per resident group, and never more than its decode will hold;
    all-GPU placement holds every page, exactly the plan's figure. ``offload="always"``: with
    the default policy a lone request keeps its pages resident while the pool has room."""
    prompt = [_prompt(LONG)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for placement in ("gpu", "hisparse"):
        with _llm(checkpoint, placement, chunk=512, offload="always") as llm:
            kv, run, seen = llm.kv, llm.runner.run, []

            def recording(batch, *, decode, finishing, kv=kv, run=run, seen=seen, **more):
                for req, n in batch:
                    b = kv.requests[req.req_id]
                    need = kv.layout.gpu_blocks_per_request(req.num_computed + n)
                    seen.append((decode, kv.gpu_held(req.req_id), need,
                                 max(len(r) for r in b.resident)))  # fmt: skip
                return run(batch, decode=decode, finishing=finishing, **more)

            llm.runner.run = recording
            (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=params)
            assert out.ok, out.error
            tokens[placement] = out.token_ids
            prefill = [s for s in seen if not s[0]]
            assert len(prefill) == 5  # 2,200 tokens in chunks of 512
            final = kv.layout.gpu_blocks_per_request(LONG)
            for _, held, need, resident in seen:
                if placement == "gpu":
                    assert held == need
                else:
                    assert held <= need and resident <= 3
            assert all(held <= final for _, held, _, _ in prefill)
            if placement == "hisparse":
                assert min(res for d, _, _, res in prefill) >= 1  # the chunk's last page
    assert tokens["hisparse"] == tokens["gpu"]
