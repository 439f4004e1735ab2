"""Async scheduling (`LLM(async_scheduling=True)`, the default): a greedy decode step leaves
its tokens on the device and the next decode of the same requests is launched reading them
there before the host reads them. On the CPU it runs on the fixed-shape decode path
(``cuda_graphs=True``: the graphs' padded step without capture), where these tests check that
it really chains steps and gives the tokens, stops, schedule and freed blocks of the
synchronous engine."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v32")


def _prompts(lengths=(40, 23, 70, 33), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _llm(path, placement: str, *, asynchronous: bool, seqs: int = 4, pool=None, **kw) -> LLM:
    """``pool``: the GPU pool in requests of ``max_model_len`` tokens (default: roomy)."""
    gib = 0.02
    if pool is not None:
        with _llm(path, placement, asynchronous=asynchronous, seqs=seqs, **kw) as probe:
            lay = probe.kv.layout
            blocks = 1 + int(pool * lay.gpu_blocks_per_request(lay.max_model_len))
            gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    return LLM(
        path,
        kv_placement=placement,
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=seqs,
        gpu_memory_gib=gib,
        cuda_graphs=True,
        async_scheduling=asynchronous,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
        **kw,
    )


def _generate(path, placement, params, prompts, *, asynchronous, seqs=4, pool=None):
    """Outputs; per decode launched on the previous decode's device tokens, whether requests
    were waiting then; and the schedule (decode?, tokens) of every step."""
    with _llm(path, placement, asynchronous=asynchronous, seqs=seqs, pool=pool) as llm:
        chained = []
        cont = llm.scheduler.continue_decode

        def counting(batch):
            step = cont(batch)
            if step is not None:
                chained.append(bool(llm.scheduler.waiting))
            return step

        llm.scheduler.continue_decode = counting
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert all(o.ok for o in outs), [o.error for o in outs]
        # nothing left behind: no request, no block, no step in flight
        assert not llm.has_unfinished_requests() and not llm.kv.requests
        assert llm.kv.gpu_blocks.num_free == llm.kv.gpu_blocks.num_usable
        steps = [(bool(s["decode"]), int(s["tokens"])) for s in llm.last_run_stats]
    return outs, chained, steps


@pytest.mark.parametrize("placement", ["hisparse"])
def test_async_decode_gives_the_synchronous_tokens(checkpoint, placement):
    """Different lengths, a stop token met mid-way and one never met: the same tokens and
    finish reasons, and steps really chained (HiSparse: its pages leave the GPU as the
    requests grow, at launch)."""
    prompts = _prompts()
    plain = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 9, 16, 30)]
    ref, chained, _ = _generate(checkpoint, placement, plain, prompts, asynchronous=False)
    assert not chained
    # stop request 0 on its 6th token and request 2 on a token it never samples
    stop0 = ref[0].token_ids[5]
    params = list(plain)
    params[0] = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop0])
    params[2] = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[10**5 % 512 + 1])
    if params[2].stop_token_ids[0] in ref[2].token_ids:
        params[2] = plain[2]
    sync, _, _ = _generate(checkpoint, placement, params, prompts, asynchronous=False)
    outs, chained, _ = _generate(checkpoint, placement, params, prompts, asynchronous=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]
    assert sync[0].finish_reason == "stop" and sync[0].token_ids[-1] == stop0
    assert len(chained) > 10  # most decodes launched before the previous one's tokens were read
    # the requests that did not stop give the plain run's tokens too
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in ref[1:]]


@pytest.mark.parametrize(
    "seqs, pool", [(4, None), (2, None), (4, 2.5)], ids=["all-running", "seqs-full", "pool-full"]
)
def test_async_length_limits_keep_the_schedule(checkpoint, seqs, pool):
    """Requests that end by ``max_tokens`` compute no step more than the synchronous engine:
    the same steps with the same token counts (the benchmarks compare schedules), also with
    requests waiting for one of ``max_num_seqs`` places or for room in the GPU pool."""
    prompts = _prompts((40, 23, 70, 33))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 20, 9)]
    kw = dict(seqs=seqs, pool=pool)
    sync, _, steps_sync = _generate(
        checkpoint, "hisparse", params, prompts, asynchronous=False, **kw
    )
    outs, chained, steps = _generate(
        checkpoint, "hisparse", params, prompts, asynchronous=True, **kw
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert steps == steps_sync and chained
    # the same pages went to the host at the same steps (demotions included)
    assert [(o.metrics.hits, o.metrics.misses) for o in outs] == [
        (o.metrics.hits, o.metrics.misses) for o in sync
    ]
    if seqs == 2 or pool is not None:  # requests waited: fewer than 4 ran at once
        assert max(n for decode, n in steps if decode) < 4
        assert any(chained)  # decodes chained while requests waited


def test_sampled_rows_are_deferred_with_the_same_draws(checkpoint):
    """Seeded sampled requests beside a greedy one: each draw takes one uniform from its
    request's generator at launch, so async scheduling gives the synchronous tokens."""
    prompts = _prompts((40, 23, 33))
    params = [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=0.8, seed=7, max_tokens=10),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3, max_tokens=10),
    ]
    sync, _, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=False)
    outs, chained, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert chained
    assert len({tuple(o.token_ids) for o in outs}) == 3


def test_unseeded_draws_do_not_see_the_extra_step(checkpoint):
    """An unseeded sampled request draws from a generator of its own (seeded from torch's
    global one): the extra step computed for a request that stops on a token does not shift
    its draws."""
    p = _prompts()
    prompts = [p[3], p[1]]  # request 0's greedy tokens vary: a stop token met mid-way
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
    ]
    torch.manual_seed(0)
    ref, _, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=False)
    first = ref[0].token_ids
    k = next(i for i in range(2, len(first)) if first[i] not in first[:i])  # first appearance
    params[0] = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[first[k]]
    )
    runs = []
    for asynchronous in (False, True):
        torch.manual_seed(0)
        outs, _, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=asynchronous)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == k + 1 and runs[0][1] == ref[1].token_ids


def test_an_error_in_a_step_leaves_the_requests_whole(checkpoint):
    """A step that raises while a decode is in flight (here its next launch): the pending
    tokens are still recorded, so a caller that goes on stepping gets the tokens of a run
    without the error."""
    prompts = _prompts((40,))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with _llm(checkpoint, "hisparse", asynchronous=False) as llm:
        ref = llm.generate(prompt_token_ids=prompts, sampling_params=params)[0].token_ids
    with _llm(checkpoint, "hisparse", asynchronous=True) as llm:
        (req,) = llm.add_request(prompt_token_ids=prompts[0], params=params)
        for _ in range(4):
            llm.step()
        assert llm._inflight is not None
        run, calls = llm.runner.run, []

        def failing_once(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("transient")
            return run(*a, **k)

        llm.runner.run = failing_once
        with pytest.raises(RuntimeError, match="transient"):
            llm.step()
        while llm.has_unfinished_requests():
            llm.step()
        assert req.output_token_ids == ref and req.finish_reason == "length"


def test_penalties_and_min_tokens_are_deferred_with_the_same_tokens(checkpoint):
    """Penalties and ``min_tokens`` count the token still on the device (each chained launch
    adds it to the request's counts): the synchronous engine's tokens for repetition,
    frequency and presence penalties (greedy and seeded sampled) and for a ``min_tokens``
    whose masked end token would otherwise stop the request early."""
    prompts = _prompts((40, 23, 33, 50))
    sync0, _, _ = _generate(
        checkpoint, "gpu", [SamplingParams(temperature=0, max_tokens=12)], prompts[:1],
        asynchronous=False,
    )  # fmt: skip
    stop = sync0[0].token_ids[3]  # met early without min_tokens
    params = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=8),
    ]
    prompts = [prompts[1], prompts[2], prompts[3], prompts[0]]
    sync, _, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=False)
    outs, chained, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=True)
    assert chained
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]
    plain, _, _ = _generate(
        checkpoint, "gpu", [SamplingParams(temperature=0, max_tokens=12)], prompts[:1],
        asynchronous=True,
    )  # fmt: skip
    assert plain[0].token_ids != outs[0].token_ids  # the penalty changed the tokens
    assert len(outs[3].token_ids) >= 8


def test_logprobs_are_deferred_with_the_same_values(checkpoint):
    """Logprobs travel with the deferred tokens: the same dicts (sampled token first, then the
    top ones) and cumulative logprobs as the synchronous engine, for greedy and seeded
    sampled rows, beside a row that asks for none."""
    prompts = _prompts((40, 23, 33))
    params = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=2),
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=0),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    sync, _, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=False)
    outs, chained, _ = _generate(checkpoint, "gpu", params, prompts, asynchronous=True)
    assert chained
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    got = [(o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in outs]
    assert got == [(o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in sync]
    first, second, third = got
    assert len(first[0]) == 8 and all(2 <= len(d) <= 3 for d in first[0])
    assert all(len(d) == 1 for d in second[0])  # the sampled token's own
    assert [next(iter(d)) for d in first[0]] == outs[0].token_ids  # sampled token first
    assert third == (None, None)


def test_abort_while_a_decode_is_in_flight(checkpoint):
    """`LLM.step` driven by hand (the server's loop): aborting a request whose token is still
    on the device drops it; the other goes on to the synchronous engine's tokens."""
    prompts = _prompts((40, 23))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with _llm(checkpoint, "hisparse", asynchronous=False) as llm:
        ref = llm.generate(prompt_token_ids=prompts[1:], sampling_params=params)[0].token_ids
    with _llm(checkpoint, "hisparse", asynchronous=True) as llm:
        a = llm.add_request(prompt_token_ids=prompts[0], params=params, request_id="a")[0]
        b = llm.add_request(prompt_token_ids=prompts[1], params=params, request_id="b")[0]
        while len(b.output_token_ids) < 3:
            llm.step()
        assert llm._inflight is not None  # a decode of both is running
        assert llm.abort_request("a")
        reported = []  # what step() says changed (and whether it was finished then)
        while llm.has_unfinished_requests():
            reported += [(r, r.finished) for r in llm.step()]
        assert all(r is not a for r, _ in reported)  # an aborted request is not reported
        assert sum(r is b and done for r, done in reported) == 1  # finished, reported once
        assert a.finish_reason == "abort" and len(a.output_token_ids) < 12
        assert b.output_token_ids == ref
        assert not llm.kv.requests and llm._inflight is None


def test_async_scheduling_is_checked():
    with pytest.raises(TypeError, match="async_scheduling"):
        LLM("smollm2", async_scheduling="yes")
