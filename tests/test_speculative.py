"""Speculative decoding (n-gram drafts, (k + 1)-row verification) on the CPU.

Lossless: greedy tokens with speculation equal those without, on tiny DSA checkpoints of both
architectures with drafts forced all accepted or all rejected (both placements, both offload
policies, chunked prompts, preemption, stop strings) and with the n-gram proposer on the real
SmolLM2 weights; every block returns to the pools. Sampled requests keep their distribution
(a chi-square test of the verifier) and, seeded, their exact tokens.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.engine.request import Request
from hisparse.engine.spec_verify import verify
from hisparse.engine.speculative import NgramProposer, SpeculativeConfig
from hisparse.validation import HiSparseConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


# --- the proposer and the config (no model) ------------------------------------------------
def test_ngram_takes_the_longest_most_recent_match():
    ng = NgramProposer(1, 3)
    # suffix [1, 2, 3] occurred at 0..2 (followed by 4, 5); [2, 3] more recently (then 9)
    assert ng.propose([1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3], 2) == [4, 5]
    assert ng.propose([5, 2, 3, 9, 8, 2, 3], 4) == [9, 8, 2, 3]
    assert ng.propose([5, 2, 3, 9, 8, 2, 7, 3], 4) == [9, 8, 2, 7]  # [3] alone, then 9...
    assert ng.propose([1, 2, 3], 3) == []  # nothing occurred before
    assert NgramProposer(2, 3).propose([4, 1, 5, 1], 2) == []  # only a 1-gram matches
    assert ng.propose([1, 2, 1, 2], 5) == [1, 2]  # what follows, up to the end
    assert ng.propose([1, 1, 1, 1], 2) == [1]  # the most recent earlier occurrence
    assert ng.propose([1, 2, 1], 0) == []


def test_speculative_config_defaults_and_errors():
    c = SpeculativeConfig()
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.max_query_len) == (5, 5, 5)
    c = SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 2, '
                             '"prompt_lookup_max": 3}')  # fmt: skip
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3, 3)
    assert SpeculativeConfig.of(None) is None and SpeculativeConfig.of(c) is c
    assert SpeculativeConfig.of({"method": "mtp"}).proposer().propose([1, 2], 2) == [-1, -1]
    bad = [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"k": 3}, "unknown field"),
        ("{not json", "not JSON"),
    ]
    for value, words in bad:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.of(value)
    with pytest.raises(TypeError):
        SpeculativeConfig.of(3)


# --- the verifier ----------------------------------------------------------------------------
def _req(i: int, **params) -> Request:
    return Request(str(i), [1, 2, 3], SamplingParams(**params))


def test_greedy_verification_takes_the_agreeing_prefix():
    V = 8
    picks = [[3, 5, 1, 2], [4, 4], [6]]  # each request's rows' argmax
    logits = torch.full((7, V), -1.0)
    for row, tok in enumerate(t for p in picks for t in p):
        logits[row, tok] = 1.0
    drafts = [[3, 5, 0], [7], []]
    v = verify(logits, [_req(i, temperature=0) for i in range(3)], drafts)
    assert v.accepted == [[3, 5], [], []]
    assert v.tokens == [1, 4, 6]


def test_sampled_verification_keeps_the_distribution():
    """Chi-square over N requests at temperature 1, two drafts each: the first token and,
    where the first draft is taken, the second have the sampler's distributions (the first
    token ``p1``, the second ``p2`` after the first draft; 11 joint outcomes). The threshold
    is the chi-square quantile at 1 - 1e-6 for 10 degrees of freedom: a correct verifier
    fails this test once in a million runs; the seeds are fixed, so it does not flake."""
    V, N = 6, 6000
    g = torch.Generator().manual_seed(0)
    row1, row2 = torch.randn(V, generator=g), torch.randn(V, generator=g)
    d1, d2 = int(row1.argsort()[-2]), int(row2.argmax())  # a likely draft, not the likeliest
    reqs = [_req(i, temperature=1.0, seed=1000 + i) for i in range(N)]
    logits = torch.stack([row1, row2, torch.zeros(V)]).repeat(N, 1)
    v = verify(logits, reqs, [[d1, d2]] * N)
    p1, p2 = torch.softmax(row1, 0).tolist(), torch.softmax(row2, 0).tolist()
    expected, seen = {}, {}
    for t in range(V):
        if t != d1:
            expected[("first", t)] = p1[t]
        expected[("second", t)] = p1[d1] * p2[t]
    for acc, tok in zip(v.accepted, v.tokens, strict=True):
        key = ("first", tok) if not acc else ("second", acc[1] if len(acc) > 1 else tok)
        seen[key] = seen.get(key, 0) + 1
    assert set(seen) <= set(expected)
    chi2 = sum((seen.get(k, 0) - N * p) ** 2 / (N * p) for k, p in expected.items())
    assert chi2 < 46.9, (chi2, seen)  # chi2.ppf(1 - 1e-6, df=10) = 46.86


# --- tiny DSA checkpoints, drafts forced ---------------------------------------------------
@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def _prompts(lengths=(40, 23, 70), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 512, (n,), generator=g).tolist() for n in lengths]


class Forced:
    """Drafts from a known continuation of each prompt: its next tokens (all taken) or
    tokens one off them (none taken)."""

    def __init__(self, prompts, outputs, accept: bool) -> None:
        self.known = list(zip(prompts, outputs, strict=True))
        self.accept = accept
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.calls += 1
        for prompt, out in self.known:
            if tokens[: len(prompt)] == prompt:
                nxt = out[len(tokens) - len(prompt) :][:k]
                return nxt if self.accept else [(t + 1) % 512 for t in nxt]
        raise AssertionError("an unknown request")


def _run(path, placement, *, spec=None, forced=None, params=GREEDY, prompts=None,
         requests=None, tokens=2048, graphs=False, **hs):  # fmt: skip
    """``requests``: a GPU pool of that many requests of max_model_len tokens at their peak
    (as test_engine.py sizes tight pools). ``graphs``: the fixed-shape decode path (run
    eagerly on the CPU), whose verify steps then take their own fixed shape."""
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, **hs)
    kw = dict(
        kv_placement=placement,
        hisparse=cfg,
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=tokens,
        speculative_config=spec,
        cuda_graphs=graphs,
    )
    gib = 0.02
    if requests is not None:
        with LLM(path, gpu_memory_gib=gib, **kw) as probe:
            lay = probe.kv.layout
            n = 1 + int(requests * lay.gpu_blocks_per_request(lay.max_model_len))
            gib = (n * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    with LLM(path, gpu_memory_gib=gib, **kw) as llm:
        if forced is not None:
            llm.scheduler.proposer = forced
        outs = llm.generate(prompt_token_ids=prompts or _prompts(), sampling_params=params)
        if graphs and spec is not None:  # the verify steps took the fixed-shape path
            assert llm.runner.verify_graphs is not None and llm.runner.verify_graphs.steps
        kv = llm.kv
        assert not kv.requests and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        assert kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "placement,offload", [("gpu", None), ("hisparse", None), ("hisparse", "always")]
)
def test_forced_drafts_give_the_plain_tokens(checkpoint, placement, offload):
    """All drafts taken and all refused: the tokens of the run without speculation, in both
    placements and offload policies (with ``always`` every row past the tail is read
    through the hot buffer, which the verifying rows share); refused drafts also with the
    lazy host mirror."""
    prompts = _prompts()
    plain = _run(checkpoint, placement, offload=offload)
    want = _tokens(plain)
    for accept in (True, False):
        forced = Forced(prompts, want, accept)
        # refused rows' host rows with the lazy mirror too (written back with their pages)
        lazy = {} if accept or placement == "gpu" else {"eager_host_mirror": False}
        outs = _run(checkpoint, placement, spec=SPEC, forced=forced, offload=offload, **lazy)
        assert _tokens(outs) == want, accept
        m = [o.metrics for o in outs]
        drafted = sum(x.spec_drafted for x in m)
        assert drafted > 0 and forced.calls > 0
        assert sum(x.spec_accepted for x in m) == (drafted if accept else 0)
        steps = sum(x.decode_steps for x in m)
        assert steps < sum(x.decode_steps for x in (o.metrics for o in plain)) or not accept
    if offload == "always":
        assert sum(o.metrics.misses for o in outs) > 0


@pytest.mark.parametrize("placement,offload", [("gpu", None), ("hisparse", "always")])
def test_fixed_shape_verify_steps_give_the_plain_tokens(checkpoint, placement, offload):
    """Verify steps on the fixed-shape path (three requests padded to four, k + 1 rows each,
    rows past a request's drafts padding; run eagerly on the CPU, the body CUDA graphs
    capture on CUDA: tests/gpu/test_engine_gpu.py): the plain tokens with drafts all taken
    and all refused."""
    prompts = _prompts()
    want = _tokens(_run(checkpoint, placement, offload=offload))
    for accept in (True, False):
        forced = Forced(prompts, want, accept)
        outs = _run(checkpoint, placement, spec=SPEC, forced=forced, offload=offload,
                    graphs=True)  # fmt: skip
        assert _tokens(outs) == want, accept
        assert sum(o.metrics.spec_accepted for o in outs) > 0 or not accept
    if offload == "always":
        assert sum(o.metrics.misses for o in outs) > 0


def test_chunked_prompts_and_preemption(checkpoint):
    """Prompts in chunks of 16 tokens beside verifying decodes, in a GPU pool tight enough
    that growing requests are preempted and recomputed: the plain tokens (top_k 4, so the
    recomputed rows select as the plain run's)."""
    prompts = _prompts((20, 23, 30, 33))
    long = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    ref = _tokens(_run(checkpoint, "gpu", params=long, prompts=prompts, top_k=4))
    tight = _run(checkpoint, "hisparse", spec=SPEC, forced=Forced(prompts, ref, True),
                 params=long, prompts=prompts, tokens=16, top_k=4, offload="always",
                 requests=1.5)  # fmt: skip
    assert sum(o.metrics.preemptions for o in tight) > 0
    assert _tokens(tight) == ref


def test_stop_strings_and_sampled_requests(checkpoint, tmp_path):
    """A stop string inside a run of accepted drafts ends the request where the plain run
    ends it; seeded sampled requests (penalties, logprobs) draw the plain run's tokens, and
    their logprobs agree to rounding."""
    from api_helpers import add_tokenizer

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    add_tokenizer(folder)
    prompts = _prompts()
    plain = _tokens(_run(folder, "hisparse"))
    stops = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            stop=[f" t{out[9]} "]) for out in plain]  # fmt: skip
    want = _run(folder, "hisparse", params=stops)
    got = _run(folder, "hisparse", spec=SPEC, forced=Forced(prompts, plain, True), params=stops)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]
    assert all(o.finish_reason == "stop" for o in got)
    sampled = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True,
                       presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
    ]  # fmt: skip
    want = _run(folder, "hisparse", params=sampled, offload="always")
    got = _run(folder, "hisparse", spec=SPEC, forced=Forced(prompts, _tokens(want), True),
               params=sampled, offload="always")  # fmt: skip
    assert _tokens(got) == _tokens(want)
    # the same logprob entries; their values from a (k + 1)-row forward round apart from a
    # one-row one's in the last bits
    for g_out, w_out in zip(got, want, strict=True):
        g_lp, w_lp = g_out.outputs[0].logprobs, w_out.outputs[0].logprobs
        assert (g_lp is None) == (w_lp is None)
        for g_d, w_d in zip(g_lp or [], w_lp or [], strict=True):
            assert list(g_d) == list(w_d)
            assert max(abs(g_d[t] - w_d[t]) for t in g_d) < 1e-4


# --- the API --------------------------------------------------------------------------------
def test_bad_speculative_config_is_refused_before_loading(tmp_path):
    for value, cls in (([4], TypeError), ({"num_speculative_tokens": -1}, ValueError)):
        with pytest.raises(cls, match=r"speculative_config|num_speculative_tokens"):
            LLM(tmp_path / "nothing-here", speculative_config=value)
    with pytest.raises(HiSparseConfigError, match="one rank"):
        LLM(tmp_path, speculative_config=SPEC, tensor_parallel_size=2)


def test_hot_buffer_grows_with_the_drafts(checkpoint):
    with LLM(checkpoint, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
             max_model_len=128, max_num_seqs=2, gpu_memory_gib=0.02,
             speculative_config=SPEC) as llm:  # fmt: skip
        assert llm.config.max_query_len == 4
        assert llm.config.device_buffer_size == 5 * llm.config.top_k


def test_refused_drafts_pause_the_lookup():
    """All of a step's drafts refused: the request drafts nothing for 1, 2, 4, ... (at most 8)
    steps; a taken draft ends the pause."""
    from hisparse.engine.scheduler import MAX_DRAFT_PAUSE, pause_drafts

    req = _req(0, temperature=0)
    pauses = []
    for _ in range(6):
        pause_drafts(req, accepted=False)
        pauses.append(req.draft_pause)
    assert pauses == [1, 2, 4, 8, 8, 8] and MAX_DRAFT_PAUSE == 8
    pause_drafts(req, accepted=True)
    assert (req.draft_pause, req.draft_backoff) == (0, 1)
