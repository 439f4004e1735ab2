"""Data-parallel attention with expert parallelism on the CPU (gloo, one process per rank):
each rank runs its own requests with its own pools, the MoE runs over every rank's tokens, and
the greedy tokens are one rank's (docs/design.md §21)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hisparse import HiSparseConfig
from hisparse.config import HiSparseConfigError
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.models.deepseek_v32 import MoE
from hisparse.models.layers import MLP
from hisparse.parallel import TensorParallelError

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch):
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")  # a hang fails in 60 s


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def v32(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v32")


def _prompts(lengths=(40, 23, 70, 33), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _engine(path, dp, *, gib=0.02, top_k=None, offload="always", **kw) -> LLM:
    return LLM(
        path,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, top_k=top_k, offload=offload),
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_gib=gib,
        data_parallel_size=dp,
        enable_expert_parallel=dp > 1,
        **kw,
    )


def _local_experts(llm: LLM) -> list[int]:
    moes = [m for m in llm.model.modules() if isinstance(m, MoE)]
    return [sum(isinstance(e, MLP) for e in m.experts) for m in moes]


def _prefix_batches() -> list[list[list[int]]]:
    """A prompt, then a batch where two prompts start with its first 6 pages (of 4 tokens)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 512, (24,), generator=g).tolist()
    tails = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 5, 7)]
    return [
        [shared + tails[0]],
        [shared + tails[1], *_prompts((30, 26), seed=4), shared + tails[2]],
    ]


def test_dp2_ep2_equals_one_rank(checkpoint):
    """Prompts longer than top_k (16), HiSparse (every page offloaded) and all-GPU: two
    data-parallel ranks with half the experts each give one rank's greedy tokens; requests
    ran on both ranks, each rank made its own host pool, and close() ends the ranks. With
    prefix caching (on by default), requests whose prompt starts like an earlier one go to
    its rank and take its cached pages: the same tokens and cached tokens as one rank."""
    prompts = _prompts()
    runs = []
    with _engine(checkpoint, 1) as one:
        ref = [o.token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
        experts = _local_experts(one)
        runs.append([o for b in _prefix_batches() for o in one.generate(
            prompt_token_ids=b, sampling_params=GREEDY)])  # fmt: skip
    with _engine(checkpoint, 2) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        states = llm._tensor_parallel_state()
        # rank 0's statistics rows are the node's forwards: 4 requests decode at the peak
        assert max(r["running"] for r in llm.last_run_stats if r["decode"]) == 4
        assert _local_experts(llm) == [n // 2 for n in experts]
        assert llm._core.assigned == [2, 2]
        runs.append([o for b in _prefix_batches() for o in llm.generate(
            prompt_token_ids=b, sampling_params=GREEDY)])  # fmt: skip
        # the prefix's three on rank 0, the others by load (a tie: the lowest rank)
        assert llm._core.assigned == [2 + 4, 2 + 1]
        workers = llm._tp.workers
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    cached = [o.metrics.cached_tokens for o in runs[1]]
    assert cached == [o.metrics.cached_tokens for o in runs[0]] and cached[1] == cached[4] == 24
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.misses for o in outs) > 0  # rows came from the host pools
    assert all(o.metrics.misses > 0 for o in outs[1::2])  # rank 1's too, in the mirrors
    pools = [s["host_pool"] for s in states]
    assert all(p["created"] and not p["shared"] for p in pools)
    assert len({s["pid"] for s in states}) == 2
    assert llm.closed and llm.kv.host_pool is None and llm.runner is None
    assert [w.exitcode for w in workers] == [0]
    with _engine(checkpoint, 2, kv_placement="gpu") as gpu:
        outs = gpu.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == ref


def test_dp2_under_preemption_with_offload_under_pressure(v32):
    """Pools tight enough to preempt on each rank, pages offloaded only under pressure: the
    tokens of one rank with the same pools, sampled ones included (a seeded request draws
    the same stream on whichever rank runs it)."""
    long = SamplingParams(temperature=0, max_tokens=40)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=16)
    prompts = _prompts((20, 23, 30, 33, 21, 27))
    with _engine(v32, 1, top_k=4, offload="under_pressure") as probe:
        lay = probe.kv.layout
        blocks = 1 + int(1.9 * lay.gpu_blocks_per_request(128))
        gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    params = [long] * 5 + [sampled]
    runs = []
    for dp in (1, 2):
        with _engine(v32, dp, gib=gib, top_k=4, offload="under_pressure") as llm:
            runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    one, two = runs
    assert all(o.ok for o in two), [o.error for o in two]
    assert sum(o.metrics.preemptions for o in two) > 0
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert [o.text for o in two] == [o.text for o in one]


def test_dead_rank_ends_the_engine(v32):
    """SIGKILL rank 1 in the middle of `generate`: TensorParallelError names the
    data-parallel rank within seconds, and the engine is closed."""
    llm = _engine(v32, 2)
    worker = llm._tp.workers[0]

    def kill() -> None:
        while len(llm.step_stats) < 5:
            time.sleep(0.005)
        os.kill(worker.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"data-parallel rank 1 was killed by SIGKILL"):
        llm.generate(prompt_token_ids=_prompts((20, 23, 25, 27)), sampling_params=long)
    assert time.monotonic() - t0 < 30
    killer.join(timeout=5)
    assert llm.closed and llm.kv.host_pool is None and llm.runner is None
    worker.join(timeout=5)
    assert not worker.is_alive()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(data_parallel_size=2, tensor_parallel_size=2), "not combined with tensor"),
        (dict(enable_expert_parallel=True), "data_parallel_size > 1"),
        (dict(data_parallel_size=3, enable_expert_parallel=True), "divisor of the model's 8"),
        (dict(data_parallel_size=2, cuda_graphs=True), "lockstep forwards run eagerly"),
    ],
)
def test_bad_parallel_arguments_fail_before_any_rank_starts(v32, kw, match):
    with pytest.raises(HiSparseConfigError, match=match):
        LLM(v32, **kw)


def test_serve_data_parallel_streams(tiny_checkpoint):
    """`hisparse serve --data-parallel-size 2 --enable-expert-parallel` (the CLI, a real
    server): four concurrent streams through the `openai` client, spread over both ranks,
    give one rank's text; `/metrics` shows the node (both ranks' pools, every token counted
    once); SIGTERM ends the server and its ranks cleanly."""
    openai = pytest.importorskip("openai")
    path = tiny_checkpoint("deepseek_v32", fp8=True)  # with a byte-level tokenizer
    prompts = [f"{i}: the quick brown fox jumps over the lazy dog {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, hisparse=HiSparseConfig(host_pool_gib=0.05, offload="always"),
             max_model_len=256, max_num_seqs=4, gpu_memory_gib=0.05) as one:  # fmt: skip
        ref = [o.text for o in one.generate(prompts, params)]
        pools = one.engine_gauges()
    cmd = [sys.executable, "-m", "hisparse", "serve", "--model", str(path), "--device", "cpu",
           "--host", "127.0.0.1", "--port", "0", "--max-model-len", "256", "--max-num-seqs",
           "4", "--gpu-memory-gib", "0.05", "--host-pool-gib", "0.05", "--offload", "always",
           "--served-model-name", "tiny", "--log-level", "warning",
           "--data-parallel-size", "2", "--enable-expert-parallel"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _served_port(proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=120, max_retries=0)  # fmt: skip

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(stream, prompts))
        assert texts == ref
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert got["hisparse:gpu_pool_blocks_total"] == 2 * pools.gpu_total
        assert got["hisparse:host_pool_blocks_total"] == 2 * pools.host_total
        assert got["hisparse:generation_tokens_total"] == 4 * 12  # rank 1's counted once
        assert got["hisparse:num_requests_running"] == got["hisparse:gpu_pool_blocks_used"] == 0
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
        assert code == 0 and "Traceback" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _served_port(proc: subprocess.Popen) -> int:
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            pytest.fail("the server did not start within 180 s")
        if m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", line):
            return int(m.group(1))


def test_online_abort_reaches_the_rank_that_runs_the_request(v32):
    """The online API (`add_request` / `step` / `abort_request`, as the server drives it):
    aborting a request that rank 1 runs ends its mirror with ``"abort"`` and frees its blocks
    on rank 1; the other request finishes as alone."""
    with _engine(v32, 1) as one:
        (ref,) = one.generate(prompt_token_ids=_prompts((40,)), sampling_params=GREEDY)
    with _engine(v32, 2) as llm:
        free = None
        while free is None or not all(free):
            llm.step()  # idle steps: every rank reports its free GPU blocks
            free = list(llm._core.free_blocks)
        (a,) = llm.add_request(_prompts((40,))[0], GREEDY, request_id="a")
        (b,) = llm.add_request(_prompts((50,), seed=2)[0], GREEDY, request_id="b")
        assert llm._core.remote["b"][0] == 1
        for _ in range(3):
            llm.step()
        assert len(b.output_token_ids) > 0 and not b.finished
        assert llm.abort_request("b") and b.finish_reason == "abort"
        assert not llm.abort_request("nope")
        while llm.has_unfinished_requests():
            llm.step()
        llm.step()
        assert a.output_token_ids == ref.token_ids and a.finish_reason == "length"
        assert llm._core.free_blocks == free  # rank 1 freed b's blocks


def test_bench_hooks_synthetic_prefill(v32):
    """`hisparse bench`'s hooks (replayed top-k, synthetic prefill): a synthetic prefill runs
    no forward on any rank, so no rank waits in the MoE's collectives for it."""
    from hisparse.bench.hooks import BenchHooks

    hooks = BenchHooks(topk_overlap=0.8, synthetic_prefill=True, seed=0)
    prompts = _prompts((40, 23, 70))
    with _engine(v32, 2, step_hooks=hooks) as llm:
        reqs = [*llm.add_request(prompts[0], GREEDY), *llm.add_request(prompts[1], GREEDY)]
        for _ in range(3):
            llm.step()  # both ranks decode
        reqs += llm.add_request(prompts[2], GREEDY)  # one rank prefills, the other only decodes
        while llm.has_unfinished_requests():
            llm.step()
        assert sorted(llm._core.assigned) == [1, 2]
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 24 for r in reqs)
