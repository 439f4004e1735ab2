"""fp8 checkpoints end to end on the CPU: `make-tiny --fp8` writes the releases' layout (e4m3
weights, 128 x 128 ue8m0 tile scales, DeepSeek's quantization_config, the MTP layer); the
loader keeps them fp8 (`Fp8Linear`, `Fp8Experts`; MLA's kv_b dequantized once) and the MTP
layer; the W8A8 model's logits stay within 2% of the same checkpoint dequantized to fp32; the
Triton kernels (interpreter) give the reference's logits; HiSparse placement gives all-GPU's
greedy tokens; bad scales are named."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.kv.row_formats import ceil_pow2
from hisparse.models import fp8
from hisparse.models.fp8_linear import Fp8Linear
from hisparse.models.fp8_moe import Fp8Experts
from hisparse.models.loader import CheckpointError, load_dsa_model
from hisparse.models.mtp import MtpLayer
from hisparse.models.tiny import make_tiny

ARCHS = ("deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """``fp8_checkpoint(arch, **overrides)``: a `make_tiny(..., fp8=True)` folder, written once
    per module."""
    built: dict[str, object] = {}

    def get(arch: str, **overrides):
        key = repr((arch, sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-fp8")
            built[key] = make_tiny(arch, out, fp8=True, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, fp8_checkpoint):
    return fp8_checkpoint(request.param)


def _prompts(lengths=(30, 17, 45), seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_make_tiny_fp8_writes_the_release_layout(ckpt) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
    }  # fmt: skip
    assert cfg["num_nextn_predict_layers"] == 1
    t = _tensors(ckpt)
    n = cfg["num_hidden_layers"]
    for name in (f"model.layers.{n}.{k}" for k in ("eh_proj.weight", "enorm.weight",
                 "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
                 "embed_tokens.weight", "self_attn.indexer.wk.weight", "mlp.gate.weight",
                 "mlp.experts.0.down_proj.weight_scale_inv")):  # fmt: skip
        assert name in t, name
    fp8_names = [k for k, v in t.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8_names) > 50
    for k in fp8_names:
        w, s = t[k], t[k + "_scale_inv"]
        assert s.dtype == torch.float32
        assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        assert torch.equal(s, ceil_pow2(s))  # ue8m0
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.0.self_attn.indexer.weights_proj.weight",
              f"model.layers.{n}.eh_proj.weight"):  # fmt: skip
        assert t[k].dtype == torch.float32 and k + "_scale_inv" not in t


@pytest.fixture(scope="module")
def models(ckpt):
    """The fp8 model and the same checkpoint dequantized to fp32."""
    return (
        load_dsa_model(ckpt, dtype=torch.float32),
        load_dsa_model(ckpt, dtype=torch.float32, fp8_weights="dequantize"),
    )


def test_loader_keeps_fp8_and_the_mtp_layer(ckpt, models) -> None:
    model, deq = models
    t = _tensors(ckpt)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert isinstance(attn.indexer.wq_b, Fp8Linear)
    assert type(attn.kv_b_proj) is torch.nn.Linear  # absorbed MLA reads it dequantized
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    want = fp8.dequantize(t[key], t[key + "_scale_inv"])
    assert torch.equal(attn.kv_b_proj.weight, want)
    moe = model.model.layers[1].mlp
    assert isinstance(moe.fp8_experts, Fp8Experts) and len(moe.experts) == 0
    assert isinstance(moe.shared_experts.down_proj, Fp8Linear)
    down = t["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(moe.fp8_experts.down_weight[3].view(torch.uint8), down.view(torch.uint8))
    (mtp,) = model.mtp
    assert isinstance(mtp, MtpLayer) and mtp.self_attn.indexer is not None
    n = model.config.num_hidden_layers
    assert torch.equal(mtp.eh_proj.weight, t[f"model.layers.{n}.eh_proj.weight"])
    assert isinstance(mtp.mlp.fp8_experts, Fp8Experts)
    # its copies of the embedding and LM head are skipped: the model's are shared
    assert mtp.shared_head.head is None and mtp.embed_tokens is None
    assert f"model.layers.{n}.shared_head.head.weight" in t
    assert torch.equal(mtp.shared_head.norm.weight, t[f"model.layers.{n}.shared_head.norm.weight"])
    assert not any(isinstance(m, Fp8Linear | Fp8Experts) for m in deq.modules())


def test_fp8_logits_within_two_percent_of_dequantized(models) -> None:
    """W8A8 against the same weights in fp32: the activations' e4m3 rounding only."""
    model, deq = models
    prompts = _prompts()
    got, want = model.prefill_logits(prompts), deq.prefill_logits(prompts)
    for a, b in zip(got, want, strict=True):
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max()
        assert rel <= 0.02, float(rel)
        assert rel > 0  # the activations really were quantized


def test_triton_kernels_give_the_reference_logits(fp8_checkpoint, monkeypatch) -> None:
    """The whole fp8 model (2 layers: the interpreter is slow) on the Triton GEMMs and grouped
    experts against the W8A8 reference: the GEMMs' fp32 sums in another order (an activation
    then rounding to the neighbouring e4m3 value now and then)."""
    path = fp8_checkpoint("deepseek_v32", num_hidden_layers=2)
    model = load_dsa_model(path, dtype=torch.float32)
    prompts = _prompts((12,))
    ref = model.prefill_logits(prompts)
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "triton")
    monkeypatch.setenv("HISPARSE_FP8_MOE", "triton")
    got = model.prefill_logits(prompts)
    for a, b in zip(got, ref, strict=True):
        assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() <= 2e-3


def test_hisparse_equals_all_gpu_on_the_fp8_path(ckpt) -> None:
    """The lossless rule on fp8 weights: the same greedy tokens with the KV cache offloaded
    (rows swapped in from the host pool) as with every row on the GPU."""
    prompts = _prompts((40, 23))
    greedy = SamplingParams(temperature=0, max_tokens=10)
    runs = {}
    for placement in ("hisparse", "gpu"):
        with LLM(
            ckpt,
            hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, offload="always"),
            kv_format="bf16",
            max_model_len=128,
            max_num_seqs=2,
            gpu_memory_gib=0.02,
            kv_placement=placement,
        ) as llm:
            assert any(isinstance(m, Fp8Linear) for m in llm.model.modules())
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
            runs[placement] = outs
    hs, gpu = runs["hisparse"], runs["gpu"]
    assert all(o.ok for o in hs + gpu)
    assert sum(o.metrics.misses for o in hs) > 0
    assert [o.token_ids for o in hs] == [o.token_ids for o in gpu]


def _rewrite(src, dst, edit) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(_tensors(src)), dst / "model.safetensors")


def test_bad_scales_name_the_tensor(tmp_path, fp8_checkpoint) -> None:
    src = fp8_checkpoint("deepseek_v32")
    name = "model.layers.2.self_attn.q_b_proj.weight_scale_inv"
    _rewrite(src, tmp_path / "shape", lambda t: {**t, name: t[name][:, :1].repeat(1, 3)})
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*does not tile"):
        load_dsa_model(tmp_path / "shape", dtype=torch.float32)
    _rewrite(src, tmp_path / "gone", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"missing tensor.*{name.replace('.', '[.]')}"):
        load_dsa_model(tmp_path / "gone", dtype=torch.float32)
    weight = "model.layers.2.mlp.experts.1.up_proj.weight"
    _rewrite(src, tmp_path / "bf16", lambda t: {**t, weight: t[weight].float()})
    with pytest.raises(CheckpointError, match=rf"{weight.replace('.', '[.]')} has a"):
        load_dsa_model(tmp_path / "bf16", dtype=torch.float32)


def test_checkpoint_headers_only_are_read_to_plan(fp8_checkpoint) -> None:
    """The index holds every tensor's dtype and shape from the headers alone."""
    from hisparse.models.checkpoint import CheckpointIndex

    path = fp8_checkpoint("glm_moe_dsa")
    index = CheckpointIndex(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(index.tensors) == set(f.keys())
        for k in list(f.keys())[:20]:
            t = f.get_tensor(k)
            assert index[k].shape == tuple(t.shape) and index[k].dtype == t.dtype


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        return b.dtype == a.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def test_fused_fp8_experts_load_like_per_expert_tensors(fp8_checkpoint, tmp_path) -> None:
    """transformers' fused 3-D experts (``gate_up_proj [E, 2I, H]``, ``down_proj``) in fp8,
    with their fused scale tiles: the same parameters as the per-expert tensors, on one rank
    and on each of two, kept fp8 or dequantized."""
    src = fp8_checkpoint("deepseek_v32")

    def fuse(t: dict) -> dict:
        out = dict(t)
        n_exp = 8
        for layer in range(5):
            p = f"model.layers.{layer}.mlp.experts"
            if f"{p}.0.gate_proj.weight" not in t:
                continue
            for suf in ("", "_scale_inv"):
                out[f"{p}.gate_up_proj{suf}"] = torch.stack([torch.cat((
                    t[f"{p}.{e}.gate_proj.weight{suf}"], t[f"{p}.{e}.up_proj.weight{suf}"]))
                    for e in range(n_exp)])  # fmt: skip
                out[f"{p}.down_proj{suf}"] = torch.stack(
                    [t[f"{p}.{e}.down_proj.weight{suf}"] for e in range(n_exp)]
                )
                for e in range(n_exp):
                    for w in ("gate_proj", "up_proj", "down_proj"):
                        del out[f"{p}.{e}.{w}.weight{suf}"]
        return out

    _rewrite(src, tmp_path / "fused", fuse)
    for kw in ({"world": 1}, {"world": 2, "rank": 1}, {"fp8_weights": "dequantize"}):
        a = dict(load_dsa_model(src, dtype=torch.float32, **kw).named_parameters())
        b = dict(load_dsa_model(tmp_path / "fused", dtype=torch.float32, **kw).named_parameters())
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), kw
