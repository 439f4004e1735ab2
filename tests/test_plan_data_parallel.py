"""``hisparse plan --data-parallel-size N --enable-expert-parallel``: weights per rank are what
a data-parallel rank keeps (whole attention and vocabulary, 1/N of the routed experts), and a
rank's planned requests are what the engine's own admission runs on each rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cli import main
from hisparse.cli_plan_node import NodePlan, rank_layouts
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.kv.cache_shapes import load_model_cache_shape
from hisparse.models.deepseek_v32 import MoE
from hisparse.models.dsa_config import DsaConfig
from hisparse.models.loader import load_dsa_model
from hisparse.parallel.expert import ExpertParallel
from hisparse.parallel.plan import WeightFormat, dsa_weight_parts
from hisparse.sim.data_parallel import simulate_data_parallel
from hisparse.sim.simulator import SimSettings
from hisparse.sim.trace import synthetic_trace

DP8 = ["plan", "--data-parallel-size", "8", "--enable-expert-parallel", "--gpu-total-gib", "141",
       "--max-model-len", "131072"]  # fmt: skip


def test_plan_data_parallel_node_beside_tensor_parallel(capsys):
    """DeepSeek-V3.2 and GLM-5 on 8 GPUs of 141 GiB: weights per rank with the experts split,
    the 128K requests a rank and the node hold for both placements and max_query_len 1-4,
    TP 8's beside them, and the node's host RAM (one pool per rank)."""
    assert main([*DP8, "--model", "deepseek-v3.2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines as the terminal's width wraps them
    assert "routed experts (58 layers x 256, 32 a rank)" in out and "97.69 GiB" in out
    # the MTP layer's embedding and LM head are the model's, counted once
    assert "multi-token prediction (1 layer; embedding, LM head shared) │ 11.62B │ 1.76 GiB" in out
    assert "HiSparse 200 (25 a rank), all-GPU 32 (4 a rank); TP 8: HiSparse 39, all-GPU 7" in out
    assert "8 x 146.77 GiB = 1,174.13 GiB for the node" in out
    for q in (1, 2, 3, 4):
        assert f"│ DP 8 + EP 8 │ {q} │" in out and f"│ TP 8 │ {q} │" in out
    assert main([*DP8, "--model", "glm-5"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "HiSparse 296 (37 a rank), all-GPU 24 (3 a rank); TP 8: HiSparse 67, all-GPU 5" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--data-parallel-size", "3", "--enable-expert-parallel"], "256 routed experts"),
        (["--data-parallel-size", "8"], "pass --enable-expert-parallel"),
        (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "not combined"),
        (["--tensor-parallel-size", "8", "--enable-expert-parallel"], "needs --data-parallel"),
    ],
)
def test_plan_data_parallel_errors(capsys, args, needle):
    assert main(["plan", "--model", "deepseek-v3.2", "--gpu-total-gib", "141", *args]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("fp8", [True, False])
def test_plan_counts_what_a_data_parallel_rank_keeps(tiny_checkpoint, fp8):
    """A rank loading with its share of the experts reads only those (fewer bytes than the
    whole checkpoint; the tensors equal the whole load's), keeps what the plan counts per
    rank, and its `ExpertParallel` finds nothing more to drop (fp8 stacked experts and bf16
    MLPs)."""
    path = tiny_checkpoint("deepseek_v32", fp8=True) if fp8 else tiny_checkpoint("deepseek_v32")
    cfg = DsaConfig.from_pretrained(path)
    fmt = WeightFormat(fp8=fp8, dtype_bytes=2)
    whole = load_dsa_model(path, dtype=torch.bfloat16)
    whole_moes = [m for m in whole.modules() if isinstance(m, MoE)]
    for rank in (0, 1):
        model = load_dsa_model(path, dtype=torch.bfloat16, experts=(4 * rank, 4))
        assert model.load_stats["bytes_read"] < whole.load_stats["bytes_read"]
        group = SimpleNamespace(rank=rank, world_size=2, group=None, backend="gloo")
        ExpertParallel(group, cfg.n_routed_experts, torch.bfloat16).install(model)
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
        planned = sum(p.bytes_per_rank for p in dsa_weight_parts(cfg, 1, fmt=fmt, ep=2))
        assert kept == planned, rank
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        assert all(m.ep is not None for m in moes)
        for m, w in zip(moes, whole_moes, strict=True):
            if fp8:
                mine, ref = m.fp8_experts.down_weight, w.fp8_experts.down_weight[4 * rank :][:4]
                assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))
            else:
                e = 4 * rank + 3
                assert torch.equal(m.experts[e].down_proj.weight, w.experts[e].down_proj.weight)


def test_planned_requests_per_rank_are_the_engines_admission(tiny_checkpoint, monkeypatch):
    """A KV budget the planner gives 2 requests of max_model_len a rank: two data-parallel
    ranks run 2 each at their peak (4 for the node, the plan's node figure) with 7 queued,
    and nobody is preempted."""
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")
    path = tiny_checkpoint("deepseek_v32")
    inp, out, block = 32, 8, 4
    max_len = inp + out
    shape = load_model_cache_shape(path, block_size=block, kv_format="bf16")
    config = HiSparseConfig(block_size=block, offload="always").resolve(shape.index_topk)
    host = 8 << 20
    per_block = rank_layouts(shape, config, 1 << 30, max_len, max_len, host, 16)[0]
    blocks = 1 + 2 * per_block.gpu_blocks_per_request(max_len)  # + the null block
    budget = blocks * per_block.gpu_bytes_per_block + per_block.staging_bytes
    planned = rank_layouts(shape, config, budget, max_len, max_len, host, 16)[0]
    assert planned.max_requests(max_len) == 2
    prompts = [[(7 * i + j) % 500 + 1 for j in range(inp)] for i in range(7)]
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    with LLM(path, hisparse=HiSparseConfig(host_pool_gib=host / 2**30, block_size=block,
                                           offload="always"),
             kv_format="bf16", max_model_len=max_len, max_num_seqs=16,
             gpu_memory_gib=budget / 2**30, schedule="prefill-first",
             data_parallel_size=2, enable_expert_parallel=True) as llm:  # fmt: skip
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert llm._core.peak_running == [2, 2]
    assert all(o.ok and len(o.token_ids) == out for o in outs)
    assert sum(o.metrics.preemptions for o in outs) == 0
    node = NodePlan("DP 2 + EP 2", 1, 0, budget, planned, planned, request_ranks=2, host_pools=2)
    assert node.per_node(max_len)[0] == sum(llm._core.peak_running) == 4
    # the simulator's data-parallel ranks: the same routing and admission
    settings = SimSettings(model=str(path), gpu_memory_gib=budget / 2**30, max_model_len=max_len,
                           max_num_seqs=16, block_size=block, host_pool_gib=host / 2**30,
                           kv_format="bf16", target="cpu", offload="always",
                           schedule="prefill-first", max_num_batched_tokens=2048)  # fmt: skip
    sim = simulate_data_parallel(settings, synthetic_trace(7, input_len=inp, output_len=out), 2)
    assert sim["routed"] == [4, 3] and sim["completed"] == 7 and sim["preemptions"] == 0
    assert [r["peak_running"] for r in sim["per_rank"]] == [2, 2] and sim["peak_running"] == 4


def test_simulate_cli_over_data_parallel_ranks(tiny_checkpoint, tmp_path):
    """`hisparse simulate --data-parallel-size 2`: the trace split over two ranks, each with
    its own pools, every request done; the node runs more at once than one rank can."""
    import json

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"arrival": 0.01 * i, "input_len": 60 + 7 * i, "output_len": 20 + i}) + "\n"
        for i in range(10)
    ))  # fmt: skip
    runs = {}
    for dp in (1, 2):
        out = tmp_path / f"sim{dp}.json"
        argv = ["simulate", "--model", str(tiny_checkpoint("deepseek_v32")), "--trace",
                str(trace), "--gpu-memory-gib", "0.001", "--block-size", "16",
                "--max-batched-tokens", "128", "--max-num-seqs", "4", "--target", "cpu",
                "--kv-placement", "hisparse,gpu", "--json", str(out),
                "--data-parallel-size", str(dp),
                "--plot", str(tmp_path / f"sim{dp}.png")]  # fmt: skip
        assert main(argv) == 0
        runs[dp] = {r["placement"].split()[0]: r for r in json.loads(out.read_text())["results"]}
    for placement, r in runs[2].items():
        assert r["completed"] == r["requests"] == sum(r["routed"]) == 10 and min(r["routed"]) > 2
        assert r["peak_running"] > runs[1][placement]["peak_running"]
        assert r["placement"] == f"{placement} DP 2"
    assert runs[2]["hisparse"]["bytes_swapped"] > 0 == runs[2]["gpu"]["bytes_swapped"]
