"""The fp8 path from the command line: ``hisparse make-tiny --fp8`` writes a release-format
checkpoint, ``hisparse generate`` loads it with a progress bar and says which GEMMs it runs,
and a checkpoint whose scales do not tile its weights fails naming the tensor."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from hisparse.cli import main


def test_make_tiny_fp8_then_generate(tmp_path, capsys) -> None:
    out = tmp_path / "glm-fp8"
    assert main(["make-tiny", str(out), "--arch", "glm_moe_dsa", "--fp8", "--layers", "2"]) == 0
    said = capsys.readouterr().out
    assert "fp8 e4m3 (128x128 ue8m0 scales, MTP layer)" in said
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["num_hidden_layers"] == 2 and (out / "tokenizer.json").is_file()

    args = ["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "3",
            "--no-chat", "--max-model-len", "256"]  # fmt: skip
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "loading weights" in said and "MB" in said  # the progress bar, bytes read
    assert "fp8 GEMMs: W8A8 reference" in said  # the CPU's kernels, named

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"
    tensors[name] = torch.ones(3, 1)
    save_file(tensors, bad / "model.safetensors")
    assert main(["generate", "--model", str(bad), "--prompt", "hi", "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert name in err and "does not tile" in err
