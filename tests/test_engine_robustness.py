"""The engine keeps serving after one request (or one run) goes wrong, and never loses a
request to its own preemption (CPU, tiny DeepSeek-V3.2 checkpoint).

Each case was a defect found by review: a sampling error or an exception inside a run left
requests holding blocks and re-ran them in the next call; a non-integer token id orphaned
the prompts queued before it; the oldest request was preempted when the newest was the one
growing; a request was preempted after it had grown too long to be recomputed with every page
resident, then failed at readmission (recompute now streams like any prefill); a lone request
failed in a GPU pool that passed the start-up check.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams, sample
from hisparse.engine.scheduler import Scheduler

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v32")


def _prompts(lengths, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _llm(path, placement="hisparse", blocks=None, offload=None, **kw) -> LLM:
    args = dict(
        kv_placement=placement,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload=offload),
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=4,
        **kw,
    )
    gib = 0.02
    if blocks is not None:
        with LLM(path, gpu_memory_gib=gib, **args) as probe:
            lay = probe.kv.layout  # a pool of `blocks` blocks beside the staging area
            n = blocks(lay) if callable(blocks) else blocks
            gib = (n * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    return LLM(path, gpu_memory_gib=gib, **args)


def _idle(llm: LLM) -> bool:
    """Nothing queued or admitted, and every block back in its pool."""
    kv, sched = llm.kv, llm.scheduler
    host_ok = kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
    return (
        not sched.waiting
        and not sched.running
        and not kv.requests
        and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        and host_ok
    )


def test_sampler_tiny_temperature_and_non_finite_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, float("nan"), 1.0], [2.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=1e-40, seed=1)] * 2 + [SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1), None]
    # a vanishing temperature samples the maximum; a row without a distribution gives None
    assert sample(logits, params, gens) == [1, None, 0]


def test_a_failed_run_leaves_the_engine_usable(checkpoint, monkeypatch):
    prompts = _prompts((20, 23, 30))
    params = SamplingParams(temperature=0, max_tokens=6)
    with _llm(checkpoint) as fresh:
        expected = [o.token_ids for o in fresh.generate(prompt_token_ids=prompts,
                                                        sampling_params=params)]  # fmt: skip
    with _llm(checkpoint) as llm:
        run = llm.runner.run
        calls = []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device lost")
            return run(*a, **k)

        monkeypatch.setattr(llm.runner, "run", failing)
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert _idle(llm)
        monkeypatch.setattr(llm.runner, "run", run)
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in again] == expected
        assert _idle(llm)


def test_a_bad_prompt_raises_and_leaves_nothing_queued(checkpoint):
    prompts = _prompts((20, 22))
    params = SamplingParams(temperature=0, max_tokens=4)
    with _llm(checkpoint) as llm:
        with pytest.raises(ValueError, match=r"prompt 1 \(of 2\): .*integers"):
            llm.generate(prompt_token_ids=[prompts[0], [5, None]], sampling_params=params)
        assert _idle(llm) and not llm.step_stats
        (out,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params)
        assert out.ok and len(out.token_ids) == 4
        steps = len(llm.step_stats)
        llm.generate(prompt_token_ids=[prompts[1]], sampling_params=params)
        assert len(llm.step_stats) - steps == 4  # one prefill and three decode steps: no orphans


def test_the_newest_request_is_preempted_even_when_it_is_the_one_growing(checkpoint, monkeypatch):
    victims = []
    preempt = Scheduler.preempt

    def recording(self, req):
        victims.append((req.req_id, [r.req_id for r in self.running]))
        preempt(self, req)

    monkeypatch.setattr(Scheduler, "preempt", recording)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    with _llm(checkpoint, "gpu", blocks=50) as llm:
        # here the newer request is the one that cannot grow (the old code preempted the older)
        outs = llm.generate(prompt_token_ids=_prompts((22, 20)), sampling_params=params)
        assert victims, "the pool was meant to force a preemption"
        assert all(victim == running[-1] for victim, running in victims)
        assert all(o.ok and len(o.token_ids) == 90 for o in outs)
        assert _idle(llm)


@pytest.mark.parametrize("requests", [1.75, 1.9])
def test_a_request_grown_long_is_preempted_and_recomputed(checkpoint, requests):
    """A recompute streams its pages to the host as a prefill does, so it holds what the
    request held before: however long a request has grown, it can be preempted and fits
    again (an all-resident recompute once could not, and such requests failed instead)."""
    blocks = lambda lay: 1 + int(requests * lay.gpu_blocks_per_request(128))  # noqa: E731
    with _llm(checkpoint, blocks=blocks) as llm:
        outs = llm.generate(prompt_token_ids=_prompts((20, 22)), sampling_params=LONG)
        for o in outs:
            assert o.ok, o.error
            assert len(o.prompt_token_ids) + len(o.token_ids) == 128
        assert sum(o.metrics.preemptions for o in outs) > 0
        # the newer request was preempted once it had grown past the tail pages
        assert outs[1].metrics.tokens_before_first_preemption > 40
        assert _idle(llm)


def test_a_lone_request_runs_to_max_model_len_in_the_smallest_accepted_pool(checkpoint):
    with _llm(checkpoint) as probe:
        minimum = probe.kv.layout.gpu_blocks_per_request(128) + 1  # + the null block
    with _llm(checkpoint, blocks=minimum) as llm:
        (out,) = llm.generate(prompt_token_ids=_prompts((20,)), sampling_params=LONG)
        assert out.ok and out.finish_reason == "length" and len(out.token_ids) == 108


def test_bad_engine_and_sampling_arguments(checkpoint):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _llm(checkpoint, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(checkpoint, max_num_seqs=0)
    with pytest.raises(ValueError, match="not a device"):
        LLM(checkpoint, device="foo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(checkpoint, device="cuda")
    with pytest.raises(ValueError, match="finite"):
        LLM(checkpoint, gpu_memory_gib=float("inf"))
    for bad in (
        dict(stop=("",)),
        dict(top_k=2.5),
        dict(max_tokens=2.5),
        dict(seed=2**70),
        dict(seed="7"),
        dict(temperature=float("inf")),
        dict(stop_token_ids=["x"]),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_failed_construction_gives_the_host_pool_back(checkpoint):
    """The process has one pinned host pool; an LLM() that fails after taking it (here: a
    step_hooks argument of the wrong type) must not keep it from the next LLM()."""
    with pytest.raises(TypeError):
        _llm(checkpoint, step_hooks=2.0)
    with _llm(checkpoint) as llm:
        (out,) = llm.generate(prompt_token_ids=_prompts((20,)), sampling_params=LONG)
        assert out.ok


def test_generate_summary_says_n_a_when_nothing_was_looked_up(checkpoint):
    """A short prompt inside the hot buffer swaps nothing, and one token has no decode rate:
    the CLI's summary says so instead of printing 0.0% and 0.0 tok/s (``offload="always"``:
    the longer prompt's rows are then read through the hot buffer)."""
    from hisparse.cli_generate import summary_line

    with _llm(checkpoint, offload="always") as llm:
        (one,) = llm.generate(
            prompt_token_ids=_prompts((5,)),
            sampling_params=SamplingParams(temperature=0, max_tokens=1),
        )
        line = summary_line(llm, one, 0.1)
        assert "decode n/a" in line and "no swaps" in line, line
        (more,) = llm.generate(prompt_token_ids=_prompts((40,)), sampling_params=LONG)
        line = summary_line(llm, more, 0.1)
        assert "tok/s" in line and "hit rate" in line, line
