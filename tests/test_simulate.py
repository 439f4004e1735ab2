"""`hisparse simulate`: its LRU against the reference resolve, its rate table, and its
running requests and swapped bytes against a real `hisparse bench` run on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hisparse.config import HiSparseConfigError
from hisparse.runtime.ops import reference as ref
from hisparse.sim.hotbuf import HotBuffers
from hisparse.sim.pcie import DEFAULT_RATES, RateTable


def _reference_hits(
    sels: list[np.ndarray], resident_from: list[np.ndarray], H: int, bs: int, NB: int
) -> list[np.ndarray]:
    """Per step, per request (hits, misses) of the reference op on the same selections."""
    Q, K = sels[0].shape
    hot_index = torch.full((Q, H), -1, dtype=torch.int32)
    lru = torch.arange(H, dtype=torch.int16).repeat(Q, 1).contiguous()
    src = (torch.arange(Q * NB, dtype=torch.int32) + 1).view(Q, NB)  # distinct host blocks
    hot_bt = (torch.arange(Q * (H // bs), dtype=torch.int32) + 1).view(Q, H // bs)
    out = []
    for sel, lo in zip(sels, resident_from, strict=True):
        pages = torch.arange(NB)[None, :]
        resident = torch.where(pages >= torch.as_tensor(lo)[:, None] // bs, 1000 + pages, 0)
        hm = torch.zeros((Q, 2), dtype=torch.int32)
        ref.resolve_residency(
            torch.as_tensor(sel, dtype=torch.int32),
            torch.arange(Q, dtype=torch.int32),
            torch.arange(Q, dtype=torch.int32),
            src,
            resident.to(torch.int32),
            hot_bt,
            hot_index,
            lru,
            bs,
            torch.empty((Q, K), dtype=torch.int32),
            torch.empty((Q, H), dtype=torch.int32),
            torch.empty((Q, H), dtype=torch.int32),
            torch.empty(Q, dtype=torch.int32),
            hit_miss=hm,
        )
        out.append(hm.numpy())
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hot_buffer_model_matches_reference(seed: int) -> None:
    """Random selections with partial overlap, shrinking and growing wanted sets, resident
    tail pages: every step's hits and misses equal the reference resolve's."""
    rng = np.random.default_rng(seed)
    Q, K, H, bs, NB = 3, 6, 8, 4, 8
    L = NB * bs
    sels, los = [], []
    prev = [rng.choice(L, K, replace=False) for _ in range(Q)]
    for _ in range(40):
        rows = []
        for q in range(Q):
            keep = prev[q][: rng.integers(0, K + 1)]
            fresh = rng.permutation(np.setdiff1d(np.arange(L), keep))[: K - len(keep)]
            row = rng.permutation(np.concatenate([keep, fresh]))
            row[rng.random(K) < 0.15] = -1  # some "none" entries
            rows.append(row)
            prev[q] = row[row >= 0]
        sels.append(np.array(rows, dtype=np.int64))
        los.append(rng.integers(L // 2, L + 1, Q))  # resident from this position on
    want = _reference_hits(sels, los, H, bs, NB)
    model = HotBuffers(Q, H, L)
    slots = np.arange(Q)
    for step, (sel, lo) in enumerate(zip(sels, los, strict=True)):
        wanted = np.where((sel >= 0) & (sel < (lo // bs * bs)[:, None]), sel, -1)
        h, m = model.step(slots, wanted)
        np.testing.assert_array_equal(np.stack([h, m], 1), want[step], err_msg=f"step {step}")


def test_hot_buffer_reset_forgets() -> None:
    hb = HotBuffers(2, 4, 16)
    sel = np.array([[1, 2, 3, -1], [4, 5, -1, -1]])
    hb.step(np.arange(2), sel)
    h, m = hb.step(np.arange(2), sel)
    assert h.tolist() == [3, 2] and m.tolist() == [0, 0]
    hb.reset(0)
    h, m = hb.step(np.arange(2), sel)
    assert h.tolist() == [0, 2] and m.tolist() == [3, 0]


def test_rate_table() -> None:
    t = RateTable.load(None)
    assert t.gb_s_at(656, 16384) == pytest.approx(22.7)
    # between measured points, held at the edges, monotone in span
    assert 13.7 < t.gb_s_at(656, 8000) < 22.7
    assert t.gb_s_at(656, 10) == pytest.approx(13.7)
    assert t.gb_s_at(656, 16384) < t.gb_s_at(2624, 16384) < t.gb_s_at(1 << 30, 16384)
    assert t.seconds(656, 0) == 0.0
    assert t.seconds(656, 16384) == pytest.approx(16384 * 656 / 22.7e9)
    with pytest.raises(ValueError):
        RateTable.from_dict({**DEFAULT_RATES, "gb_s": DEFAULT_RATES["gb_s"][:-1]})
    json.dumps(DEFAULT_RATES)  # the default is a valid --pcie-rates file


# -- against the engine: `hisparse bench`'s own cell on the CPU ------------------------------

BLOCK, INPUT, OUTPUT, N, BATCHED = 16, 100, 140, 6, 128


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tiny_checkpoint) -> str:
    return str(tiny_checkpoint(request.param))


_MODES = {"always": ("hisparse", "always"), "under_pressure": ("hisparse", "under_pressure"),
          "all-gpu": ("gpu", None)}  # fmt: skip
# Each regime once per architecture. All-GPU: < 0.002 GiB decodes that cannot grow preempt
# (0.001; 0.0007 preempts the same way), at 0.004 all six requests run. HiSparse: 3 of the 6
# at once at 0.001 (glm_moe_dsa at 0.0007: 2 of 6, the same way), all 6 at 0.004, and at
# 0.0007 deepseek_v32's decodes preempt.
_CASES = [
    pytest.param(arch, gib, mode, id=f"{arch}-{gib}-{mode}")
    for arch in ("deepseek_v32", "glm_moe_dsa")
    for gib in (0.0007, 0.001, 0.004)
    for mode in _MODES
    if gib != 0.0007 or (arch == "deepseek_v32" and mode != "all-gpu")
]


@pytest.mark.parametrize(("tiny", "gib", "mode"), _CASES, indirect=["tiny"])
def test_simulate_predicts_cpu_bench(tiny: str, gib: float, mode: str) -> None:
    """The bench's running requests, preemptions, hits and swapped bytes, step by step; with
    ``offload="under_pressure"`` too (pages kept resident while there is room, demoted when
    not: the simulator runs the engine's own manager); and on all-GPU."""
    import argparse

    placement, offload = _MODES[mode]

    from hisparse.bench.cell import run_cell
    from hisparse.bench.hooks import BenchHooks
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM
    from hisparse.sim.simulator import SimSettings, simulate
    from hisparse.sim.trace import synthetic_trace

    max_len = INPUT + OUTPUT
    with LLM(
        tiny,
        kv_placement=placement,
        hisparse=HiSparseConfig(block_size=BLOCK, offload=offload),
        max_num_seqs=N,
        max_model_len=max_len,
        gpu_memory_gib=gib,
        max_num_batched_tokens=BATCHED,
        step_hooks=BenchHooks(topk_overlap=0.8, synthetic_prefill=True),
    ) as llm:
        args = argparse.Namespace(input_len=INPUT, output_len=OUTPUT, prefill="synthetic")
        bench = run_cell(llm, args, N, 0)
        assert bench["first_request_id"] == 0  # the engine's first requests
        steps = llm.last_run_stats
    settings = SimSettings(
        model=tiny,
        placement=placement,
        gpu_memory_gib=gib,
        max_model_len=max_len,
        max_num_seqs=N,
        block_size=BLOCK,
        max_num_batched_tokens=BATCHED,
        target="cpu",
        offload=offload,
    )
    sim = simulate(settings, synthetic_trace(N, input_len=INPUT, output_len=OUTPUT))
    assert bench["preemptions"] == sim["preemptions"]
    if placement == "gpu" or ("v32" in tiny and gib < 0.0008):  # tight: decodes preempt
        assert (gib < 0.002) == (sim["preemptions"] > 0)
    assert sim["peak_running"] == pytest.approx(bench["peak_running"], rel=0.05)
    if placement == "gpu":
        assert sim["bytes_swapped"] == bench["bytes_swapped"] == 0
    else:
        assert sim["bytes_swapped"] == pytest.approx(bench["bytes_swapped"], rel=0.15)
        assert sim["bytes_swapped"] > 0
        assert (bench["demotions"] > 0) == (offload == "under_pressure")  # the pool is tight
    # the model claims more than the tolerances: the same schedule and misses every step
    cols = {c: i for i, c in enumerate(sim["step_columns"])}
    got = [(bool(s[cols["decode"]]), int(s[cols["tokens"]]), int(s[cols["running"]]),
            int(s[cols["hits"]]), int(s[cols["misses"]])) for s in sim["steps"]]  # fmt: skip
    want = [(bool(s["decode"]), int(s["tokens"]), int(s["running"]), int(s.get("hits", 0)),
             int(s.get("misses", 0))) for s in steps]  # fmt: skip
    assert got == want


def test_sampled_leaders_estimate_all(tiny: str) -> None:
    """Simulating one leader of several and counting the others as its average stays near
    the full simulation (every leader's replay follows one model)."""
    from hisparse.sim.simulator import SimSettings, simulate
    from hisparse.sim.trace import synthetic_trace

    def run(k: int | None) -> dict:
        s = SimSettings(model=tiny, gpu_memory_gib=0.001, max_model_len=INPUT + OUTPUT,
                        max_num_seqs=N, block_size=BLOCK, max_num_batched_tokens=BATCHED,
                        target="cpu", sim_leaders=k)  # fmt: skip
        return simulate(s, synthetic_trace(N, input_len=INPUT, output_len=OUTPUT))

    full, one = run(None), run(1)
    assert one["leaders_simulated"] == 1 < full["leaders_simulated"]
    assert one["peak_running"] == full["peak_running"]
    assert one["bytes_swapped"] == pytest.approx(full["bytes_swapped"], rel=0.2)


def test_bench_id_offsets() -> None:
    """The bench numbers its warm-up requests first: one cell per padded graph size up to
    the cell's with CUDA graphs, the cell's own size without."""
    from hisparse.engine.cuda_graphs import padded_sizes
    from hisparse.sim.cli import bench_id_offsets

    cuda = {"settings": {"device": "cuda"}}
    warm = sum(b for b in padded_sizes(36) if b < 36) + 36
    assert bench_id_offsets(cuda, [36], "cpu") == [warm]
    assert bench_id_offsets({"settings": {"device": "cpu"}}, [4, 8], "cuda") == [4, 16]
    assert bench_id_offsets({"settings": {"no_warmup": True}}, [4, 8], "cpu") == [0, 4]
    # what the bench recorded wins over the reckoning, per placement
    cells = (("hisparse", 4, 7), ("hisparse", 8, 19), ("gpu", 4, 5), ("gpu", 8, 9))
    rows = [dict(placement=p, concurrency=n, first_request_id=i) for p, n, i in cells]
    recorded = {**cuda, "results": rows}
    assert bench_id_offsets(recorded, [4, 8], "cuda", "hisparse") == [7, 19]
    assert bench_id_offsets(recorded, [4, 8], "cuda", "gpu") == [5, 9]
    assert bench_id_offsets(recorded, [4, 16], "cuda", "gpu")[1] != 9  # not recorded: reckoned


def test_cli_trace_file(tiny: str, tmp_path) -> None:
    """A JSONL trace with staggered arrivals through the command: JSON out, waits counted,
    every request done, and a plot when matplotlib is there."""
    from hisparse.cli import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"arrival": 0.01 * i, "input_len": 60 + 7 * i, "output_len": 20 + i}) + "\n"
        for i in range(10)
    ))  # fmt: skip
    out = tmp_path / "sim.json"
    argv = ["simulate", "--model", tiny, "--trace", str(trace), "--gpu-memory-gib", "0.001",
            "--block-size", "16", "--max-batched-tokens", "128", "--max-num-seqs", "4",
            "--target", "cpu", "--kv-placement", "hisparse,gpu", "--json", str(out),
            "--plot", str(tmp_path / "sim.png")]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    by = {r["placement"]: r for r in doc["results"]}
    assert set(by) == {"hisparse", "gpu"}
    for r in by.values():
        assert r["completed"] == r["requests"] == 10
        assert 1 <= r["peak_running"] <= 4
    assert by["hisparse"]["bytes_swapped"] > 0 == by["gpu"]["bytes_swapped"]
    assert by["gpu"]["admission_wait_max"] > 0  # all-GPU holds fewer: requests wait
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_compare_refuses_a_bench_of_the_models_own_top_k(tiny: str, tmp_path, capsys) -> None:
    """A bench run with ``--topk-overlap off`` has no replayable selections: a clear error
    naming the flag (exit 2), not a traceback."""
    from hisparse.cli import main

    bench = tmp_path / "bench.json"
    settings = dict(model=tiny, input_len=64, output_len=8, concurrency="2",
                    kv_placement="hisparse", topk_overlap="off", gpu_memory_gib=0.001)  # fmt: skip
    bench.write_text(json.dumps({"settings": settings, "results": []}))
    assert main(["simulate", "--compare", str(bench), "--target", "cpu"]) == 2
    assert "--topk-overlap='off'" in capsys.readouterr().err


def test_sampled_requests_estimate_all(tiny: str) -> None:
    """Simulating every other request's hot buffers and counting the rest as their mean
    keeps the schedule exact and the bytes near the full simulation (``offload="always"``:
    every request reads through its hot buffer, as the estimate assumes)."""
    from hisparse.sim.simulator import SimSettings, simulate
    from hisparse.sim.trace import synthetic_trace

    def run(f: float) -> dict:
        s = SimSettings(model=tiny, gpu_memory_gib=0.004, max_model_len=INPUT + OUTPUT,
                        max_num_seqs=N, block_size=BLOCK, max_num_batched_tokens=BATCHED,
                        target="cpu", sample_requests=f, offload="always")  # fmt: skip
        return simulate(s, synthetic_trace(2 * N, input_len=INPUT, output_len=OUTPUT))

    full, half = run(1.0), run(0.5)
    assert half["peak_running"] == full["peak_running"]
    assert half["decode_steps"] == full["decode_steps"]
    assert half["bytes_swapped"] == pytest.approx(full["bytes_swapped"], rel=0.1)
    assert half["warm_start_bytes"] == full["warm_start_bytes"]
    assert half["bytes_swapped"] != full["bytes_swapped"]  # an estimate, not the same run


@pytest.mark.parametrize("offload", ["always", "under_pressure"])
@pytest.mark.parametrize("plan", [3, 5, 8])
def test_prompts_at_a_page_boundary_run_the_plan_without_preemption(
    tiny: str, plan: int, offload: str
) -> None:
    """Prompts that end on a page boundary, in a pool of exactly ``plan`` requests at
    ``max_model_len``: the engine's scheduler (run by the simulator) holds the plan and
    preempts nobody. Without the page of growth admission keeps in reserve, a prompt admitted
    while the others' decodes were one step from opening a page ran the plan + 1 and was
    preempted a step later (as on the H200's GLM-5 run)."""
    from hisparse.sim.simulator import SimSettings, Simulator
    from hisparse.sim.trace import synthetic_trace

    inp, out = 8 * BLOCK, 8
    kw = dict(model=tiny, max_model_len=inp + out, max_num_seqs=16, block_size=BLOCK,
              target="cpu", offload=offload, schedule="prefill-first",
              max_num_batched_tokens=4096)  # fmt: skip
    lay = Simulator(SimSettings(gpu_memory_gib=0.01, **kw)).kv.layout
    blocks = 1 + plan * lay.gpu_blocks_per_request(inp + out)  # + the null block
    gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    sim = Simulator(SimSettings(gpu_memory_gib=gib, **kw))
    assert sim.kv.layout.max_requests_gpu(inp + out) == plan
    run = sim.run(synthetic_trace(plan + 3, input_len=inp, output_len=out))
    assert run["peak_running"] == plan
    assert run["preemptions"] == 0


def test_a_shared_document_is_prefilled_once(tiny: str) -> None:
    """``shared_prefix`` (questions over one document): the engine's scheduler with prefix
    caching prefills the document once; every other request starts after its cached pages."""
    import dataclasses

    from hisparse.sim.simulator import SimSettings, simulate
    from hisparse.sim.trace import synthetic_trace

    s = SimSettings(model=tiny, gpu_memory_gib=0.004, max_model_len=INPUT + OUTPUT,
                    max_num_seqs=N, block_size=BLOCK, max_num_batched_tokens=BATCHED,
                    target="cpu", shared_prefix=96)  # fmt: skip
    trace = synthetic_trace(2 * N, input_len=INPUT, output_len=20)
    shared, cold = simulate(s, trace), simulate(dataclasses.replace(s, shared_prefix=0), trace)
    assert cold["cached_tokens"] == 0 and cold["prefill_tokens"] == 2 * N * INPUT
    assert shared["cached_tokens"] == (2 * N - 1) * 96
    assert shared["prefill_tokens"] == cold["prefill_tokens"] - shared["cached_tokens"]


def test_speculation_counts_the_rows_and_the_larger_hot_buffers(tiny: str) -> None:
    """``num_speculative_tokens`` K: hot buffers of max_query_len = K + 1 (the engine's
    ``(K + 2) · top_k`` rows, leased from the GPU pool by each running request); drafts all taken
    finish the same requests in about 1 / (K + 1) of the decode steps, each resolving every
    row's selection; all refused, about as many steps as without (the drafts' pause)."""
    from hisparse.sim.simulator import SimSettings, Simulator, simulate
    from hisparse.sim.trace import synthetic_trace

    kw = dict(model=tiny, gpu_memory_gib=0.004, max_model_len=INPUT + OUTPUT, max_num_seqs=N,
              block_size=BLOCK, max_num_batched_tokens=BATCHED, target="cpu",
              offload="always")  # fmt: skip
    trace = synthetic_trace(N, input_len=INPUT, output_len=OUTPUT)
    plain_sim, spec_sim = (
        Simulator(SimSettings(**kw)),
        Simulator(SimSettings(**kw, num_speculative_tokens=3)),
    )
    top_k = plain_sim.config.top_k
    assert plain_sim.config.device_buffer_size == 2 * top_k
    assert spec_sim.config.device_buffer_size == 5 * top_k
    # a running request leases its larger hot buffers from the GPU pool
    assert spec_sim.kv.gpu_need(INPUT + OUTPUT) > plain_sim.kv.gpu_need(INPUT + OUTPUT)
    plain = simulate(SimSettings(**kw), trace)
    taken = simulate(SimSettings(**kw, num_speculative_tokens=3, spec_acceptance=1.0), trace)
    refused = simulate(SimSettings(**kw, num_speculative_tokens=3, spec_acceptance=0.0), trace)
    for run in (plain, taken, refused):
        assert run["completed"] == N and not run["errors"]
    assert taken["decode_steps"] < plain["decode_steps"] / 3
    assert plain["decode_steps"] <= refused["decode_steps"] <= 1.2 * plain["decode_steps"]
    assert taken["misses"] > 0 and taken["hits"] > 0
    with pytest.raises(HiSparseConfigError, match="spec_acceptance"):
        Simulator(SimSettings(**kw, num_speculative_tokens=3, spec_acceptance=1.5))
