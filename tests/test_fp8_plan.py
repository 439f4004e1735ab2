"""``hisparse plan``'s weights per rank are the bytes the engine allocates: the plan's formula
(`hisparse.parallel.plan`) against the parameters `load_dsa_model` keeps on each rank of tiny
fp8 and bf16 checkpoints, and against the sharded meta skeleton of DeepSeek-V3.2's real layer
shapes (``v32-shapes``) at 8 ranks; the real releases' figures."""

from __future__ import annotations

import pytest
import torch

from hisparse.cli import main
from hisparse.models.checkpoint import CheckpointIndex
from hisparse.models.checkpoint_writer import (
    UE8M0,
    release_config,
    release_tensors,
    write_checkpoint,
)
from hisparse.models.dsa_config import DsaConfig
from hisparse.models.loader import load_dsa_model, shard_weight_bytes
from hisparse.models.tiny import make_tiny, tiny_config_kwargs
from hisparse.parallel.plan import (
    WeightFormat,
    dsa_config_of,
    dsa_weight_parts,
    weight_format_of,
    widest_rank_parts,
)


def _kept(model: torch.nn.Module) -> int:
    """The weights a rank keeps (the MTP layer's embedding and head are the model's: the
    loader keeps no copies, so they count once, as the plan counts them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _planned(cfg: DsaConfig, tp: int, rank: int, fp8: bool) -> int:
    parts = dsa_weight_parts(cfg, tp, rank=rank, fmt=WeightFormat(fp8=fp8, dtype_bytes=2))
    return sum(p.bytes_per_rank for p in parts)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("fp8", [True, False])
def test_plan_counts_what_each_rank_allocates(arch, fp8, tmp_path) -> None:
    """Tiny checkpoints in the releases' layout with the MTP layer, fp8 and bf16, 1 and 2
    ranks (a slice of q_b starting inside a scale tile on rank 1), loaded in bf16."""
    if fp8:
        path = make_tiny(arch, tmp_path, fp8=True)
    else:
        kwargs = tiny_config_kwargs(arch, fp8=True)  # the same widths, unquantized
        path = write_checkpoint(arch, tmp_path, kwargs, fp8_format=None, dtype=torch.bfloat16)
    cfg = DsaConfig.from_pretrained(path)
    assert weight_format_of(str(path)).fp8 == fp8
    assert cfg.num_nextn_predict_layers == 1
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        model = load_dsa_model(path, dtype=torch.bfloat16, rank=rank, world=tp)
        assert _kept(model) == _planned(cfg, tp, rank, fp8), (tp, rank)


def test_plan_counts_deepseek_v32_layer_shapes_at_8_ranks() -> None:
    """The real widths (hidden 7168, 128 heads, experts 2048 wide) at 8 ranks, from the
    sharded meta skeleton of what `make-tiny --preset v32-shapes --fp8` writes."""
    kwargs = tiny_config_kwargs("deepseek_v32", "v32-shapes")
    cfg_json = release_config("deepseek_v32", kwargs, fmt=UE8M0, mtp=1, dtype=torch.bfloat16)
    cfg = DsaConfig.from_dict(cfg_json)
    index = CheckpointIndex.of_tensors("v32-shapes", release_tensors(cfg, UE8M0, 1, torch.bfloat16))
    for rank in (0, 7):
        got = shard_weight_bytes(cfg, index, rank=rank, world=8, fp8_format=UE8M0)
        assert got == _planned(cfg, 8, rank, True)


def test_release_plans() -> None:
    """DeepSeek-V3.2 with its MTP layer is the release's 685B parameters less the MTP layer's
    copies of the embedding and LM head (1.85B, shared with the model); at 8 ranks a rank
    holds 82.05 GiB (fp8 experts, bf16 kv_b, vocabulary-parallel embedding and head)."""
    cfg = dsa_config_of("deepseek-v3.2")
    parts = widest_rank_parts(cfg, 8)
    assert round(sum(p.params for p in parts) / 1e9, 1) == 683.5
    assert round(sum(p.bytes_per_rank for p in parts) / 2**30, 2) == 82.05
    bf16 = widest_rank_parts(cfg, 8, fmt=WeightFormat(fp8=False))
    assert sum(p.bytes_per_rank for p in bf16) / 2**30 > 141  # does not fit a node of H200s


def test_plan_cli_reports_the_format(capsys) -> None:
    args = ["plan", "--model", "deepseek-v3.2", "--tensor-parallel-size", "8",
            "--gpu-total-gib", "141"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "683.5B parameters" in out and "82.05 GiB" in out
    assert (
        "multi-token prediction (1 layer; embedding, LM head shared)" in out
        and "as the engine holds them" in out
    )
