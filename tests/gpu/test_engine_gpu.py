"""The engine on CUDA: HiSparse placement (pinned host pool, Triton swap-in on the copy
stream) gives the same greedy tokens as all-GPU placement on tiny DSA checkpoints.

Checkpoints: ``HISPARSE_TINY_DIR`` (written on a CPU machine by `make_tiny`), else written here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.bench.hooks import BenchHooks
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory) -> Path:
    base = os.environ.get("HISPARSE_TINY_DIR")
    if base and (Path(base) / request.param / "config.json").is_file():
        return Path(base) / request.param
    from hisparse.models.tiny import make_tiny

    out = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, out, seed=0)
    return out


@pytest.mark.parametrize("offload", [None, "always"], ids=["default", "always"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp32"])
def test_hisparse_equals_all_gpu_on_cuda(checkpoint, kv_format, offload):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70, 33)]
    params = SamplingParams(temperature=0, max_tokens=32)
    tokens = {}
    for placement in ("gpu", "hisparse"):
        with LLM(
            checkpoint,
            kv_placement=placement,
            device="cuda",
            dtype="float32",
            hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload=offload),
            kv_format=kv_format,
            max_model_len=256,
            gpu_memory_gib=0.05,
        ) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert all(o.ok for o in outs), [o.error for o in outs]
        tokens[placement] = [o.token_ids for o in outs]
        if placement == "hisparse" and offload == "always":
            assert sum(o.metrics.misses for o in outs) > 0
    assert tokens["hisparse"] == tokens["gpu"]


@pytest.mark.parametrize("synthetic", [True, False], ids=["synthetic", "model-prefill"])
def test_topk_replay_is_lossless_on_cuda(checkpoint, synthetic):
    """Benchmark modes on CUDA: replayed top-k (and synthetic prefill) give HiSparse the
    all-GPU tokens and the same selections; the swap-in timer reads its CUDA events."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (90, 61, 120)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, logs = {}, {}
    for placement in ("gpu", "hisparse"):
        with LLM(
            checkpoint,
            kv_placement=placement,
            device="cuda",
            dtype="float32",
            hisparse=HiSparseConfig(
                host_pool_gib=0.01, block_size=4, device_buffer_size=32, offload="always"
            ),
            kv_format="bf16",
            max_model_len=192,
            gpu_memory_gib=0.05,
            step_hooks=BenchHooks(topk_overlap=0.8, synthetic_prefill=synthetic, timing=True),
        ) as llm:
            llm.runner.hooks.replay.log = []
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            log = llm.runner.hooks.replay.log
            logs[placement] = sorted((k, n, ld, s.tolist()) for ld, k, n, s in log)
            dec = [s for s in llm.step_stats if s["decode"]]
        assert all(o.ok for o in outs), [o.error for o in outs]
        tokens[placement] = [o.token_ids for o in outs]
        if placement == "hisparse":
            assert sum(o.metrics.misses for o in outs) > 0
            assert sum(o.metrics.hits for o in outs) > sum(o.metrics.misses for o in outs)
            assert sum(s["gather_ms"] for s in dec) > 0 and sum(s["resolve_ms"] for s in dec) > 0
    assert tokens["hisparse"] == tokens["gpu"]
    assert logs["hisparse"] == logs["gpu"]


# --- CUDA graphs: decode batches padded to captured sizes, swap-in inside the graph ----------


def _generate(checkpoint, placement, prompts, params, *, cuda_graphs, blocks=None, llm_kw=None,
              **hs):  # fmt: skip
    """Outputs and the sizes whose graphs were captured (blocks: GPU pool size in blocks);
    `_generate.kinds`: the last call's steps per (size, every page resident) kind, and
    `_generate.captured_kinds` its captured graphs' kinds."""
    kw = dict(
        kv_placement=placement,
        device="cuda",
        dtype="float32",
        kv_format="bf16",
        max_model_len=256,
        max_num_seqs=4,
        cuda_graphs=cuda_graphs,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, **hs),
        **(llm_kw or {}),
    )
    gib = 0.05
    if blocks is not None:
        with LLM(checkpoint, gpu_memory_gib=gib, **kw) as probe:
            lay = probe.kv.layout  # a pool of `blocks` blocks beside the staging area
            n = blocks(lay) if callable(blocks) else blocks
            gib = (n * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    with LLM(checkpoint, gpu_memory_gib=gib, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        graphs = llm.runner.graphs
        captured = graphs.captured_sizes if graphs is not None and graphs.capture else []
        _generate.kinds = dict(graphs.steps_by_kind) if graphs is not None else {}
        _generate.captured_kinds = sorted(graphs.graphs) if graphs is not None else []
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs, captured


def test_cuda_graphs_lossless_and_same_tokens_as_eager(checkpoint):
    """Batches of 3, 2, 1 requests (padded to 4, 2, 1) replayed from graphs: HiSparse ==
    all-GPU, and graphs-on tokens == graphs-off (plain eager) tokens, prompts > top_k."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (32, 9, 20)]
    tokens = {}
    for placement in ("gpu", "hisparse"):
        for graphs in (True, False):
            outs, captured = _generate(checkpoint, placement, prompts, params, cuda_graphs=graphs,
                                       offload="always")  # fmt: skip
            tokens[placement, graphs] = [o.token_ids for o in outs]
            if graphs:
                assert captured == [1, 2, 4]
            if placement == "hisparse":
                assert sum(o.metrics.misses for o in outs) > 0
    assert tokens["hisparse", True] == tokens["gpu", True]
    assert tokens["hisparse", True] == tokens["hisparse", False]
    assert tokens["gpu", True] == tokens["gpu", False]


def test_cuda_graphs_lossless_at_minimum_hot_buffer(checkpoint):
    """Hot buffer at its minimum (= top_k): every step swaps, graphs on, HiSparse == all-GPU."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 23, 30)]
    params = SamplingParams(temperature=0, max_tokens=60)
    ref, _ = _generate(checkpoint, "gpu", prompts, params, cuda_graphs=True, top_k=4)
    hs, captured = _generate(checkpoint, "hisparse", prompts, params, cuda_graphs=True,
                             top_k=4, device_buffer_size=4, offload="always")  # fmt: skip
    assert captured
    assert sum(o.metrics.misses for o in hs) > 0
    assert [o.token_ids for o in hs] == [o.token_ids for o in ref]


def test_cuda_graphs_under_preemption_equal_eager_and_all_gpu_until_preempted(checkpoint):
    """A GPU pool so tight that a request is preempted and recomputed, hot buffer at minimum.

    Losslessness is about placement under the same schedule. Preemption changes the schedule
    (batch sizes, a recomputed prefill instead of token-by-token KV writes), and on CUDA the
    kernels' reduction splits and GEMM algorithms follow the batch shape, so a recomputed
    request may round differently from an all-GPU run that never preempted (on the CPU the
    same comparison happens to be bit-stable: tests/test_engine.py). So here: the graph path
    equals the eager path under the same preempting schedule, every request finishes, and
    every request's tokens equal the all-GPU run's up to the first preemption.
    """
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 23, 30)]
    params = SamplingParams(temperature=0, max_tokens=60)
    ref, _ = _generate(checkpoint, "gpu", prompts, params, cuda_graphs=True, top_k=4)
    # a pool of 1.3 max_model_len requests at their peak preempts (both archs: the third
    # request, admitted beside two with a page of growth in reserve, preempted at ~50 tokens)
    blocks = lambda lay: 1 + int(1.3 * lay.gpu_blocks_per_request(256))  # noqa: E731
    tight, captured = _generate(checkpoint, "hisparse", prompts, params, cuda_graphs=True,
                                blocks=blocks, top_k=4, device_buffer_size=4,
                                offload="always")  # fmt: skip
    eager, _ = _generate(checkpoint, "hisparse", prompts, params, cuda_graphs=False,
                         blocks=blocks, top_k=4, device_buffer_size=4,
                         offload="always")  # fmt: skip
    assert captured
    assert sum(o.metrics.preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in eager]
    assert all(len(o.token_ids) == params.max_tokens for o in tight)
    # The requests start decoding together, so each had about as many tokens as the first
    # preempted one when it was preempted: the schedules agree until then.
    n = min(o.metrics.tokens_before_first_preemption or 10**9 for o in tight)
    assert 0 < n < params.max_tokens
    assert [o.token_ids[:n] for o in tight] == [o.token_ids[:n] for o in ref]


def test_cuda_graphs_replay_the_same_selections(checkpoint):
    """Top-k replay inside the graphs: the eager step's selections and tokens, per real row."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (90, 61, 120)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for placement in ("gpu", "hisparse"):
        for graphs in (True, False):
            kw = dict(kv_placement=placement, device="cuda", dtype="float32", kv_format="bf16",
                      max_model_len=192, max_num_seqs=4, gpu_memory_gib=0.05, cuda_graphs=graphs,
                      step_hooks=BenchHooks(topk_overlap=0.8, synthetic_prefill=True),
                      hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4,
                                              device_buffer_size=32,
                                              offload="always"))  # fmt: skip
            with LLM(checkpoint, **kw) as llm:
                llm.runner.hooks.replay.log = []
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                log = sorted((k, n, ld, s.tolist()) for ld, k, n, s in llm.runner.hooks.replay.log)
                if graphs:
                    assert llm.runner.graphs.graphs
            runs[placement, graphs] = ([o.token_ids for o in outs], log)
    assert runs["hisparse", True] == runs["hisparse", False]
    assert runs["gpu", True] == runs["gpu", False] == runs["hisparse", True]


@pytest.mark.parametrize("eager_mirror", [True, False], ids=["eager-mirror", "lazy-mirror"])
def test_offload_under_pressure_with_graphs_equals_all_gpu(checkpoint, eager_mirror):
    """``offload="under_pressure"`` on CUDA with graphs: with room nothing is read through the
    hot buffers (every step is of the kind that looks rows up in the resident table); in a
    pool of the plan's requests the prompts keep pages in the slack and the decodes demote
    them (write-back first with the lazy mirror, on the compute stream before the replay) and
    their steps take the general graph (a size first seen all resident captures both kinds at
    once). The tokens are all-GPU's under the same schedule (no preemption here)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70, 33)]
    params = SamplingParams(temperature=0, max_tokens=48)
    hs = dict(top_k=4, offload="under_pressure", eager_host_mirror=eager_mirror)
    ref, _ = _generate(checkpoint, "gpu", prompts, params, cuda_graphs=True, top_k=4)
    roomy, captured = _generate(checkpoint, "hisparse", prompts, params, cuda_graphs=True, **hs)
    assert captured
    assert all(resident for _, resident in _generate.kinds)
    assert _generate.captured_kinds == [(b, k) for b in captured for k in (False, True)]
    assert sum(o.metrics.misses + o.metrics.hits for o in roomy) == 0
    assert [o.token_ids for o in roomy] == [o.token_ids for o in ref]
    blocks = lambda lay: 1 + int(4.2 * lay.gpu_blocks_per_request(256))  # noqa: E731
    tight, _ = _generate(checkpoint, "hisparse", prompts, params, cuda_graphs=True,
                         blocks=blocks, **hs)  # fmt: skip
    assert sum(o.metrics.preemptions for o in tight) == 0
    assert sum(o.metrics.misses for o in tight) > 0  # demoted rows came back from the host
    assert not all(resident for _, resident in _generate.kinds)  # demoted: the general graph
    assert [o.token_ids for o in tight] == [o.token_ids for o in ref]


def test_async_scheduling_on_cuda_graphs_gives_the_synchronous_tokens(checkpoint):
    """Decodes launched on the previous decode's device tokens (async scheduling, the
    default) against the synchronous engine, both on graphs: the same tokens and finish
    reasons in both placements, a request stopping on a token mid-way included."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70)]
    plain = [SamplingParams(temperature=0, max_tokens=n) for n in (32, 9, 20)]
    ref, _ = _generate(checkpoint, "gpu", prompts, plain, cuda_graphs=True,
                       llm_kw=dict(async_scheduling=False))  # fmt: skip
    stop = ref[0].token_ids[6]
    params = [SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]), *plain[1:]]
    runs = {}
    for placement in ("gpu", "hisparse"):
        for asynchronous in (False, True):
            outs, captured = _generate(checkpoint, placement, prompts, params, cuda_graphs=True,
                                       llm_kw=dict(async_scheduling=asynchronous))  # fmt: skip
            assert captured == [1, 2, 4]
            runs[placement, asynchronous] = [(o.token_ids, o.finish_reason) for o in outs]
    assert runs["gpu", True] == runs["gpu", False] == runs["hisparse", True]
    assert runs["hisparse", False] == runs["gpu", False]
    assert runs["gpu", True][0][1] == "stop"


_SAMPLING_CASES = {
    # sampled rows beside a greedy one, drawn on the device from one host-drawn uniform per row
    "seeded": (6, [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3, max_tokens=16),
    ]),
    # penalties and min_tokens counting the token still on the device
    "penalties": (8, [
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=4, max_tokens=16, frequency_penalty=0.6,
                       presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=12),
    ]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_SAMPLING_CASES))
def test_async_scheduling_with_sampling_options_on_cuda(checkpoint, case):
    """Seeded sampling, penalties and ``min_tokens``: the same tokens with async scheduling
    on and off (both on graphs), in both placements."""
    seed, params = _SAMPLING_CASES[case]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70)]
    runs = {}
    for placement in ("gpu", "hisparse"):
        for asynchronous in (False, True):
            outs, _ = _generate(checkpoint, placement, prompts, params, cuda_graphs=True,
                                llm_kw=dict(async_scheduling=asynchronous))  # fmt: skip
            runs[placement, asynchronous] = [o.token_ids for o in outs]
    assert runs["gpu", True] == runs["gpu", False]
    assert runs["hisparse", True] == runs["hisparse", False] == runs["gpu", False]


def test_async_scheduling_with_logprobs_on_cuda(checkpoint):
    """Logprobs computed on the device at launch and copied to pinned memory with the
    tokens (async scheduling) against the synchronous engine, both on graphs: the same tokens,
    logprob dicts and cumulative logprobs."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 70)]
    params = [
        SamplingParams(temperature=0, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, logprobs=1),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    runs = {}
    for asynchronous in (False, True):
        outs, _ = _generate(checkpoint, "gpu", prompts, params, cuda_graphs=True,
                            llm_kw=dict(async_scheduling=asynchronous))  # fmt: skip
        runs[asynchronous] = [
            (o.token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in outs
        ]
    assert runs[True] == runs[False]
    assert all(len(d) >= 3 for d in runs[True][0][1]) and runs[True][2][1] is None
