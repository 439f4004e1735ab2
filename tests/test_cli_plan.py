"""``hisparse plan``: output carries the layout and both capacities; errors exit 2 cleanly."""

from __future__ import annotations

import json

import pytest

from hisparse.cli import main

DEEPSEEK = [
    "plan", "--model", "deepseek-v3.2", "--gpu-memory-gib", "60", "--host-pool-gib", "1024",
    "--max-model-len", "131072",
]  # fmt: skip


def test_plan_deepseek_prints_layout_and_capacities(capsys):
    assert main(DEEPSEEK) == 0
    out = capsys.readouterr().out
    assert "357,407 blocks x 3,076,352 B" in out  # host pool: rows + the indexer copy
    assert "24,969 blocks x 2,576,640 B" in out  # GPU pool: blocks of 5 indexer pages
    assert "prefill staging (outside the pool): 2,080 pages" in out
    assert "layers.0-60.attn" in out  # every layer in one pack
    assert "HiSparse 52, all-GPU 10" in out
    assert "5.20x" in out
    assert "bytes per request = 5.13x (reached: 101%)" in out  # the byte bound
    assert "│ 1 │ resident │ layers.0-60.attn" in out and "99.8%" in out  # fill of the total
    # a bigger prefill step reserves a bigger staging area
    assert main([*DEEPSEEK, "--max-batched-tokens", "16384"]) == 0
    assert "2,304 pages of one layer" in capsys.readouterr().out


def test_plan_glm5_shorter_context_and_bf16(capsys):
    args = [
        "plan",
        "--model",
        "glm-5",
        "--gpu-memory-gib",
        "60",
        "--host-pool-gib",
        "512",
        "--max-model-len",
        "131072",
        "--context-len",
        "32768",
        "--kv-format",
        "bf16",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "21 with their own indexer" in out and "bf16 1152 B" in out
    assert "Requests of 32,768 tokens: HiSparse" in out


def test_plan_from_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v32", "num_hidden_layers": 4, "index_topk": 256})
    )
    args = [
        "plan",
        "--model",
        str(tmp_path / "config.json"),
        "--gpu-memory-gib",
        "1",
        "--host-pool-gib",
        "4",
        "--max-model-len",
        "8192",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "top_k 256" in out and "all-GPU" in out


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (["--host-pool-gib", "2"], "Set host_pool_gib >= 5.88 GiB"),
        (["--gpu-memory-gib", "1"], "Give the KV cache >= 1.23 GiB"),
        (
            ["--device-buffer-size", "1024"],
            "--device-buffer-size 1024: must be between max_query_len * top_k = 1 * 2048 = 2048",
        ),
        (["--context-len", "200000"], "--context-len=200000 must be between 1 and"),
        (["--model", "no-such-model"], "no such file or folder, and not a preset name"),
    ],
)
def test_plan_errors_exit_2_without_traceback(capsys, override, needle):
    args = list(DEEPSEEK)
    flag = override[0]
    if flag in args:
        args[args.index(flag) + 1] = override[1]
    else:
        args += override
    assert main(args) == 2
    captured = capsys.readouterr()
    assert needle in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_unaligned_row_names_the_kv_format_that_fits(tmp_path, capsys):
    """fp8_ds_mla rows at kv_lora_rank 256 are 392 B, not a multiple of 16: the fix to offer
    first is --kv-format bf16 (640 B rows), not padding a row whose format is fixed."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v32", "num_hidden_layers": 4, "index_topk": 256,
                    "kv_lora_rank": 256})
    )  # fmt: skip
    args = ["plan", "--model", str(tmp_path), "--gpu-memory-gib", "1", "--host-pool-gib", "4",
            "--max-model-len", "8192"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a fp8_ds_mla KV row is 392 bytes" in err
    assert "pass --kv-format bf16 (rows of 640 bytes)" in err and "pad it" not in err
    assert main([*args, "--kv-format", "bf16"]) == 0
    assert "bf16 640 B" in capsys.readouterr().out


def test_unsupported_model_type_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3"}))
    args = list(DEEPSEEK)
    args[args.index("--model") + 1] = str(path)
    assert main(args) == 2
    assert "'qwen3' is not supported" in capsys.readouterr().err


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_plan_tensor_parallel_node(capsys):
    """One 8-GPU node of 141 GiB: weights per rank (fp8 block-scaled, as the engine holds
    them: tests/test_fp8_plan.py), the KV budget left, requests of 128K with HiSparse and
    all-GPU, and one host copy for the node."""
    args = ["plan", "--model", "deepseek-v3.2", "--tensor-parallel-size", "8",
            "--gpu-total-gib", "141", "--max-model-len", "131072"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "683.5B parameters" in out and "82.05 GiB" in out
    assert "= 44.85 GiB" in out  # 90% of 141 GiB less the weights
    assert "HiSparse 39, all-GPU 7" in out
    assert "190.60 GiB for the node, one copy shared by its 8 ranks" in out
    assert main(["plan", "--model", "glm-5", "--tensor-parallel-size", "8",
                 "--gpu-total-gib", "141"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "753.3B parameters" in out and "indexer (21 layers, whole)" in out
    # 3 does not divide 128 heads; 2 GPUs cannot hold the weights
    assert main([*args[:4], "3", *args[5:]]) == 2
    assert "does not divide the model's 128 attention heads" in capsys.readouterr().err
    assert main([*args[:4], "2", *args[5:]]) == 2
    assert "weights per rank exceed" in capsys.readouterr().err


def test_plan_defaults_the_pool_flags_from_the_model(capsys):
    """--max-model-len defaults to the model's context (as the engine's), the host pool to
    what the requests that fit the GPU need (as with --gpu-total-gib)."""
    assert main(["plan", "--model", "DeepSeek-V3.2", "--gpu-memory-gib", "60"]) == 0
    out = capsys.readouterr().out
    assert "max_model_len 163,840" in out and "Requests of 163,840 tokens" in out


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_plan_parameter_formula_counts_the_model(arch):
    """The planner's per-kind parameter counts add up to the model's own parameters (tiny
    shapes of both architectures; GLM's IndexShare layers own no indexer)."""
    import torch

    from hisparse.models.deepseek_v32 import DsaForCausalLM
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs
    from hisparse.parallel.plan import dsa_weight_parts

    cfg = DsaConfig.from_dict({"model_type": arch, **tiny_config_kwargs(arch)})
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    own = sum(p.numel() for p in model.parameters())
    assert sum(p.params for p in dsa_weight_parts(cfg, 1)) == own


def test_plan_counts_the_speculative_rows_hot_buffers(capsys):
    """Two draft tokens a step: three rows per request, so the hot buffer defaults to
    (2 + 2) * top_k rows and fewer requests fit beside them."""
    assert main([*DEEPSEEK, "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "device_buffer_size 8192 (128 blocks per hot group)" in out
    assert "HiSparse 46, all-GPU 10" in out
    assert main([*DEEPSEEK, "--num-speculative-tokens", "-1"]) == 2
    assert "--num-speculative-tokens -1: must be >= 0" in capsys.readouterr().err


def test_plan_counts_the_mtp_layers_kv(capsys, tiny_checkpoint):
    """MTP drafts: each request also holds the MTP layer's rows and indexer keys (one more
    index group), so one fewer request of 128K fits than with n-gram drafts; a checkpoint
    without the layer is refused, naming the field."""
    mtp = ["--num-speculative-tokens", "2", "--speculative-method", "mtp"]
    assert main([*DEEPSEEK, *mtp]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2 with its MTP layer: 62 layers, 62 with their own indexer" in out
    assert "HiSparse 45, all-GPU 10" in out
    assert main([*DEEPSEEK, "--speculative-method", "mtp"]) == 2
    assert "give at least 1" in capsys.readouterr().err
    plain = str(tiny_checkpoint("deepseek_v32"))  # transformers' writer: no MTP layer
    assert main(["plan", "--model", plain, "--gpu-memory-gib", "1", "--host-pool-gib", "1",
                 "--kv-format", "bf16", *mtp]) == 2  # fmt: skip
    assert "num_nextn_predict_layers is 0 or missing" in capsys.readouterr().err
