"""``hisparse plan`` for DeepSeek-V4 (`hisparse.kv.v4_plan`, `hisparse.cli_plan_v4`): the
planner's all-GPU figure equals the engine's own block accounting on the tiny checkpoint, the
groups add up by hand at the release's dimensions, and the CLI prints the layouts for one GPU
and a TP 8 node."""

from __future__ import annotations

import pytest
import torch

from hisparse.cli import main
from hisparse.kv.v4_plan import (
    request_bytes,
    requests_that_fit,
    totals,
    v4_config_of,
    weight_bytes_per_rank,
)
from hisparse.models.v4_config import CSA, HCA, V4Config

M = 2**20


def test_engine_figure_equals_the_engines_block_accounting(tiny_checkpoint):
    """The ``engine`` layout's bytes of a request are the blocks the engine's all-GPU pool
    gives it plus one slot of the compressors' carried state."""
    from hisparse import LLM

    ckpt = tiny_checkpoint("deepseek_v4")
    engine = LLM(ckpt, kv_placement="gpu", max_num_seqs=2, max_model_len=128, device="cpu")
    try:
        layout, runner = engine.kv.layout, engine.runner
        value_bytes = runner.model.head.weight.element_size()
        state = runner.v4_state
        slots = next(iter(state.stores.values())).shape[0]
        state_bytes = sum(t.numel() * t.element_size() for t in state.stores.values()) // slots
        config = V4Config.from_pretrained(ckpt)
        for n in (1, 37, 64, 128):
            got = request_bytes(config, n, "engine", value_bytes=value_bytes,
                                block_size=layout.block_size)  # fmt: skip
            gpu, host = totals(got)
            assert host == 0
            assert gpu == layout.gpu_bytes_per_request(n)[1] + state_bytes
            assert next(g.gpu for g in got if g.name == "compressor state") == state_bytes
    finally:
        engine.close()


def test_hisparse_engine_figure_equals_the_engines_block_accounting(tiny_checkpoint):
    """The ``hisparse-engine`` layout's bytes of a request are the pages the engine's HiSparse
    pools give it at its peak (every indexer-kind page, three resident pages of entries, the
    hot buffer) plus one slot of carried state; its host bytes the host blocks admission
    reserves."""
    from hisparse import LLM, HiSparseConfig

    ckpt = tiny_checkpoint("deepseek_v4")
    with LLM(ckpt, kv_placement="hisparse", max_num_seqs=2, max_model_len=128, device="cpu",
             hisparse=HiSparseConfig(block_size=8)) as engine:  # fmt: skip
        layout, runner = engine.kv.layout, engine.runner
        value_bytes = runner.model.head.weight.element_size()
        state = runner.v4_state
        slots = next(iter(state.stores.values())).shape[0]
        state_bytes = sum(t.numel() * t.element_size() for t in state.stores.values()) // slots
        config = V4Config.from_pretrained(ckpt)
        for n in (1, 37, 64, 128):
            got = request_bytes(config, n, "hisparse-engine", value_bytes=value_bytes,
                                block_size=layout.block_size,
                                device_buffer_size=engine.config.device_buffer_size)  # fmt: skip
            gpu, host = totals(got)
            assert gpu == layout.gpu_bytes_per_request(n)[0] + state_bytes
            assert host == layout.host_blocks_per_request(n) * layout.host_block_bytes


def test_groups_at_the_release_dimensions():
    """V4-Flash at 1M tokens, counted by hand in bf16: 21 CSA layers keep 262,144 entries of
    512 values and as many indexer keys of 128; 20 HCA layers 8,192 entries; 43 windows of 128
    rows. HiSparse moves the CSA entries to the host and adds a hot buffer of 1,024 entries."""
    cfg = v4_config_of("deepseek-v4-flash")
    assert cfg is not None and cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    n = 2**20
    gpu = {g.name: g for g in request_bytes(cfg, n, "gpu")}
    hs = {g.name: g for g in request_bytes(cfg, n, "hisparse")}
    assert gpu["CSA entries"].gpu == 21 * (n // 4) * 512 * 2 == hs["CSA entries"].host
    assert hs["CSA entries"].gpu == 0
    assert gpu["indexer keys"].gpu == hs["indexer keys"].gpu == 21 * (n // 4) * 128 * 2
    assert gpu["HCA entries"].gpu == 20 * (n // 128) * 512 * 2
    assert gpu["sliding window rows"].gpu == 43 * 128 * 512 * 2
    assert hs["CSA hot buffer"].gpu == 21 * 1024 * 512 * 2
    # carried state: CSA rings of 8 positions (kv + gate, two series of 512 and of 128),
    # HCA rings of 128 positions (kv + gate of 512)
    assert gpu["compressor state"].gpu == (21 * 2 * 8 * 2 * (512 + 128) + 20 * 2 * 128 * 512) * 2
    g_gpu, g_host = totals(request_bytes(cfg, n, "hisparse"))
    assert g_host == gpu["CSA entries"].gpu and g_gpu < totals(request_bytes(cfg, n, "gpu"))[0] / 4
    budget = 60 * 2**30
    assert requests_that_fit(request_bytes(cfg, n, "hisparse"), budget, 100 * 2**30) == 19


def test_weight_count_matches_the_model(tiny_checkpoint):
    """The analytic parameter count is within 0.1% of the model's own (norm vectors and
    small biases aside), on the tiny checkpoint's configuration."""
    from hisparse.models.deepseek_v4 import DeepseekV4ForCausalLM

    cfg = V4Config.from_pretrained(tiny_checkpoint("deepseek_v4"))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    want = sum(p.numel() for p in model.parameters())
    assert abs(weight_bytes_per_rank(cfg)[0] - want) <= 1e-3 * want + 4096


def test_cli_prints_one_gpu_and_a_node(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--max-model-len", "1048576",
                 "--gpu-memory-gib", "60"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for text in ("128K-token", "512K-token", "1M-token", "HiSparse (design)", "One GPU",
                 "all-GPU, engine today", "CSA hot buffer"):  # fmt: skip
        assert text in out, text
    assert main(["plan", "--model", "deepseek-v4-pro", "--gpu-total-gib", "141",
                 "--tensor-parallel-size", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Node" in out and "1M-token" in out and "weights 1,573.0B parameters" in out


def test_cli_bad_input_says_what_to_change(capsys):
    rc = main(["plan", "--model", "deepseek-v4-flash", "--gpu-total-gib", "60",
               "--tensor-parallel-size", "3"])  # fmt: skip
    assert rc == 2
    assert "does not divide" in capsys.readouterr().err
    rc = main(["plan", "--model", "deepseek-v4-pro", "--gpu-total-gib", "80",
               "--tensor-parallel-size", "1"])  # fmt: skip
    assert rc == 2
    assert "more GPUs" in capsys.readouterr().err
    # no GPU given: both ways to give one, with values that work
    assert main(["plan", "--model", "deepseek-v4-flash", "--max-model-len", "1048576"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-gib, e.g. 60" in err and "--gpu-total-gib, e.g. 141" in err


@pytest.mark.parametrize("placement", ["engine", "gpu", "hisparse"])
def test_a_short_request(placement):
    """Below one window: every group holds only what the request wrote."""
    cfg = v4_config_of("deepseek-v4-flash")
    groups = {g.name: g for g in request_bytes(cfg, 3, placement, block_size=64)}
    assert groups["HCA entries"].gpu == (20 * 64 * 512 * 2 if placement == "engine" else 0)
    assert groups["CSA hot buffer"].gpu == 0


def test_simulate_runs_v4(capsys):
    """`hisparse simulate` plays V4-Flash's HiSparse placement (its specs from a meta model,
    the top-k replayed over entries); data parallelism is refused as the engine refuses it."""
    argv = ["simulate", "--model", "deepseek-v4-flash", "--gpu-memory-gib", "60",
            "--max-model-len", "131072", "--input-len", "20000", "--output-len", "8",
            "--concurrency", "2", "--sim-leaders", "2"]  # fmt: skip
    assert main(argv) == 0
    assert "Simulated" in capsys.readouterr().out
    assert main([*argv, "--data-parallel-size", "2"]) == 2
    assert "DeepSeek-V4 has no data-parallel" in capsys.readouterr().err
