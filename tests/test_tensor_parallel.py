"""Tensor parallelism on the CPU (gloo, one process per rank): the same greedy tokens as one
rank, the same selections on every rank, one host pool per node, and failures that end the
engine instead of hanging it (docs/design.md §18)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.config import HiSparseConfigError
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.parallel import TensorParallelError
from hisparse.parallel.shm import SHM_DIR
from hisparse.testing.tp_hooks import SelectionDigest

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch):
    # a hang would fail in 60 s, not the default 600
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def v32(tiny_checkpoint):
    """One architecture is enough for the launch and failure tests."""
    return tiny_checkpoint("deepseek_v32")


def _prompts(lengths=(40, 23, 70, 33), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _shm_files() -> set[str]:
    """The pool files of the engines this process drives (named ``hisparse-<driver pid>-``):
    not those of another pytest-xdist worker's engines, which come and go meanwhile."""
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"hisparse-{os.getpid()}-")}


def _engine(path, tp, *, gib=0.02, top_k=None, hooks=None, offload=None, **kw) -> LLM:
    return LLM(
        path,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, top_k=top_k, offload=offload),
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_gib=gib,
        tensor_parallel_size=tp,
        step_hooks=hooks,
        **kw,
    )


def _check_one_pool(states, host_pool_bytes):
    """Exactly one rank created the node's pool; every rank maps that one file; the layout's
    host bytes are one rank's."""
    pools = [s["host_pool"] for s in states]
    assert sum(p["created"] for p in pools) == 1 and pools[0]["created"]
    assert all(p["shared"] for p in pools)
    assert len({p["inode"] for p in pools}) == 1
    assert {s["host_pool_bytes"] for s in states} == {host_pool_bytes}
    assert len({s["pid"] for s in states}) == len(states)


def test_tp2_equals_tp1_with_one_host_pool(checkpoint):
    """Prompts longer than top_k (16), HiSparse placement: tp=2 gives tp=1's greedy tokens;
    both ranks selected the same rows, hold bit-identical GPU pools (MLA rows, indexer keys
    and hot buffers are the same on every rank) and share one host pool that rank 0 writes."""
    prompts = _prompts()
    # (tensor parallelism runs HiSparse without the prefix cache, whose indexer-key copy
    # would make one rank's host blocks larger: the pools compare without it)
    with _engine(checkpoint, 1, offload="always", enable_prefix_caching=False) as one:
        ref = [o.token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
        one_pool = one.kv.layout.host_pool_bytes
    before = _shm_files()
    with _engine(checkpoint, 2, hooks=SelectionDigest(), offload="always") as llm:
        assert _shm_files() == before  # the name goes once every rank mapped the pool
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        states = llm._tensor_parallel_state()
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.misses for o in outs) > 0  # rows really came from the host pool
    _check_one_pool(states, one_pool)
    assert [s["host_writer"] for s in states] == [True, False]
    for key in ("selections", "hot_state", "gpu_pool"):
        assert states[0][key] == states[1][key], key
    assert states[0]["selections"] not in (None, 0)


def test_tp2_equals_tp1_under_preemption(checkpoint):
    """A GPU pool tight enough to preempt and recompute: the same schedule and tokens."""
    long = SamplingParams(temperature=0, max_tokens=60)
    prompts = _prompts((20, 23, 30, 33))
    with _engine(checkpoint, 1, top_k=4) as probe:
        # about two requests of max_model_len at their peak beside the prefill staging area
        lay = probe.kv.layout
        blocks = 1 + int(1.9 * lay.gpu_blocks_per_request(128))
        gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    runs = []
    for tp in (1, 2):
        with _engine(checkpoint, tp, gib=gib, top_k=4) as llm:
            runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=long))
    one, two = runs
    assert all(o.ok for o in two), [o.error for o in two]
    assert sum(o.metrics.preemptions for o in two) > 0
    assert [o.metrics.preemptions for o in two] == [o.metrics.preemptions for o in one]
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_tp2_offload_under_pressure_with_the_lazy_mirror(v32):
    """``offload="under_pressure"`` in a pool too small for every page: the ranks demote the
    same requests at the same steps (rank 0 writes the lazy mirror back first, the other
    waits on its fence) and give one rank's tokens."""
    prompts = _prompts((40, 23, 70, 33))
    hs = HiSparseConfig(host_pool_gib=0.01, block_size=4, eager_host_mirror=False,
                        offload="under_pressure")  # fmt: skip
    kw = dict(hisparse=hs, kv_format="bf16", max_model_len=128, max_num_seqs=4)
    with LLM(v32, gpu_memory_gib=0.02, **kw) as probe:
        lay = probe.kv.layout
        blocks = 1 + int(4.2 * lay.gpu_blocks_per_request(128))
        gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    runs = []
    for tp in (1, 2):
        with LLM(v32, gpu_memory_gib=gib, tensor_parallel_size=tp, **kw) as llm:
            runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY))
            runs.append(llm.scheduler.demotions)
    one, one_demoted, two, two_demoted = runs
    assert all(o.ok for o in two), [o.error for o in two]
    assert one_demoted == two_demoted > 0
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_tp2_lazy_mirror_and_all_gpu_placement(v32):
    """The lazy host mirror (rows written back when their page leaves the GPU, outside the
    forward: the other rank's next step waits on the writer's fence) and the all-GPU
    placement give the tokens of one rank."""
    prompts = _prompts()
    with _engine(v32, 1) as one:
        ref = [o.token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    lazy = LLM(
        v32,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, eager_host_mirror=False,
                                offload="always"),
        kv_format="bf16", max_model_len=128, max_num_seqs=4, gpu_memory_gib=0.02,
        tensor_parallel_size=2,
    )  # fmt: skip
    with lazy:
        outs = lazy.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == ref
        assert sum(o.metrics.misses for o in outs) > 0
    with _engine(v32, 2, kv_placement="gpu") as gpu:
        outs = gpu.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == ref


def test_smollm2_tp3_equals_tp1():
    """SmolLM2 (9 query / 3 KV heads) over 3 ranks: one KV head each, the host row of each
    token holding the three ranks' slices side by side (the one-rank pool's size)."""
    smollm2 = pytest.importorskip("hisparse.models.smollm2")
    try:
        smollm2.smollm2_gguf_path()
    except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
        pytest.skip(str(err))
    from pydoc_data.topics import topics

    top_k = 96  # above the indexer's 4 sinks + 64-token window, below the prompt
    params = SamplingParams(temperature=0, max_tokens=6)
    runs = []
    for tp in (1, 3):
        with LLM(
            "smollm2",
            hisparse=HiSparseConfig(
                top_k=top_k, device_buffer_size=top_k, host_pool_gib=0.05, offload="always"
            ),  # rows read through the hot buffer
            max_model_len=512,
            gpu_memory_gib=0.1,
            max_num_seqs=1,
            tensor_parallel_size=tp,
        ) as llm:
            ids = llm.tokenizer.encode_chat([{"role": "user", "content": topics["for"][:500]}])
            assert len(ids) > top_k
            outs = llm.generate(prompt_token_ids=[ids], sampling_params=params)
            assert all(o.ok for o in outs), [o.error for o in outs]
            runs.append((outs[0], llm._tensor_parallel_state(), llm.kv.layout.host_pool_bytes))
    (one, _, one_pool), (three, states, _) = runs
    assert three.token_ids == one.token_ids
    assert three.metrics.misses == one.metrics.misses > 0
    _check_one_pool(states, one_pool)
    assert all(s["host_writer"] for s in states)  # each rank writes its KV head's slice
    assert len({tuple(s["hot_state"]) for s in states}) == 1  # the same selections


def test_tensor_parallel_size_must_divide_the_heads(v32):
    import multiprocessing

    with pytest.raises(HiSparseConfigError, match=r"tensor_parallel_size=3 does not divide "
                       r"the model's 4 attention heads"):  # fmt: skip
        _engine(v32, 3)
    assert not multiprocessing.active_children()  # refused before any rank started
    pytest.importorskip("hisparse.models.smollm2")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's 9"):
        LLM("smollm2", tensor_parallel_size=2)


def test_killed_worker_ends_the_engine(v32):
    """SIGKILL a worker in the middle of `generate`: the driver raises TensorParallelError
    naming the rank within seconds, the engine is closed, no pool file stays, and a new
    engine starts in the same process."""
    before = _shm_files()
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
    with pytest.raises(TensorParallelError, match=r"rank 1 was killed by SIGKILL"):
        llm.generate(prompt_token_ids=_prompts((20, 23, 25, 27)), sampling_params=long)
    assert time.monotonic() - t0 < 30
    killer.join(timeout=5)
    assert llm.closed and llm.kv.host_pool is None and llm.runner is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompt_token_ids=[[1, 2, 3]])
    assert _shm_files() == before
    worker.join(timeout=5)
    assert not worker.is_alive()
    with _engine(v32, 2) as again:  # the process group was released
        (out,) = again.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert out.ok


TORCHRUN_SCRIPT = """
import json, sys
import torch
from hisparse import HiSparseConfig, LLM, SamplingParams

torch.set_num_threads(1)
path, out, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
results = []
for top_k in (None, 4):  # two engines in a row: the other ranks serve each
    with LLM(path, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, top_k=top_k),
             kv_format="bf16", max_model_len=128, max_num_seqs=4, gpu_memory_gib=0.02,
             tensor_parallel_size=2) as llm:  # on rank 1 this call serves rank 0
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0, max_tokens=12))
        results.append([o.token_ids for o in outs])
with open(out, "w") as f:
    json.dump(results, f)
"""


def test_torchrun_ranks_serve_rank_0(v32, tmp_path):
    """The same engine under torchrun (env:// rendezvous): rank 1 serves the engines rank 0
    builds and exits with it; the tokens are one rank's."""
    import json
    import subprocess
    import sys

    import hisparse

    prompts = _prompts((20, 33))
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = tmp_path / "out.json"
    src = os.path.dirname(os.path.dirname(hisparse.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), str(v32), str(out), json.dumps(prompts)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    params = SamplingParams(temperature=0, max_tokens=12)
    for top_k, tokens in zip((None, 4), got, strict=True):
        with _engine(v32, 1, top_k=top_k) as one:
            ref = one.generate(prompt_token_ids=prompts, sampling_params=params)
        assert tokens == [o.token_ids for o in ref]
