"""``hisparse make-tiny`` writes checkpoints the loader reads back, and refuses to clobber."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open

from hisparse.cli import main
from hisparse.models.loader import load_dsa_model


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_writes_a_checkpoint_the_loader_reads(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / arch
    assert main(["make-tiny", "--arch", arch, "--layers", "3", "--seed", "7", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and f"arch {arch}" in printed and "3 layers" in printed
    assert "MiB" in printed
    model = load_dsa_model(out, dtype=torch.float32)
    assert model.config.arch == arch
    assert model.config.num_hidden_layers == 3
    # The seed reaches the weights: a second checkpoint with another seed differs.
    again = tmp_path / "again"
    assert main(["make-tiny", "--arch", arch, "--layers", "3", "--seed", "8", str(again)]) == 0
    other = load_dsa_model(again, dtype=torch.float32)
    w = "model.embed_tokens.weight"
    assert not torch.equal(model.state_dict()[w], other.state_dict()[w])


def test_dtype_option_sets_the_stored_dtype(tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    args = ["make-tiny", "--arch", "deepseek_v32", "--layers", "1", "--dtype", "bfloat16"]
    assert main([*args, str(out)]) == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_refuses_a_non_empty_folder_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    stale = out / "model-00001-of-00002.safetensors"
    stale.write_bytes(b"old shard")
    (out / "notes.txt").write_text("keep me")
    args = ["make-tiny", "--arch", "deepseek_v32", "--layers", "1", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert stale.exists() and not (out / "config.json").exists()

    assert main([*args, "--force"]) == 0
    assert not stale.exists(), "--force must drop the old checkpoint's shards"
    assert (out / "notes.txt").read_text() == "keep me"
    assert load_dsa_model(out, dtype=torch.float32).config.num_hidden_layers == 1


def test_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["make-tiny", "--arch", "glm_moe_dsa", str(a_file)]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["make-tiny", "--arch", "glm_moe_dsa", "--layers", "0", str(tmp_path / "z")]) == 2
    assert "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: unknown arch
        main(["make-tiny", "--arch", "llama", str(tmp_path / "y")])
