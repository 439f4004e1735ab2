"""DeepSeek-V4 (`hisparse.models.deepseek_v4`) against transformers' reference forward.

One tiny checkpoint (`v4_tiny`: window 8, entries of 4 and 8 tokens, index_topk 3, all three
layer kinds, hash and score routing) serves every test; prompts of 45 tokens span the window,
11 CSA entries and 5 HCA entries.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hisparse.models.v4_config import CSA, HCA, SLIDING, V4Config  # noqa: E402
from hisparse.models.v4_loader import load_v4_model  # noqa: E402
from hisparse.models.v4_quant import (  # noqa: E402
    dequantize_tensor,
    pack_fp4,
    unpack_fp4,
)

TOL = 1e-4
LEN = 45


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v4")


@pytest.fixture(scope="module")
def ref(ckpt):
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # the release's names load with nothing left over
    return model.eval()


@pytest.fixture(scope="module")
def model(ckpt):
    return load_v4_model(ckpt)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return torch.randint(2, 512, (2, LEN), generator=g)


@pytest.fixture(scope="module")
def want(ref, prompts):
    with torch.no_grad():
        return ref(prompts, use_cache=False).logits


def test_checkpoint_has_release_names(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn"} <= names
    assert (
        "layers.1.attn.indexer.compressor.ape" in names and "layers.1.attn.kv_norm.weight" in names
    )
    assert "layers.1.attn.compressor.norm.weight" in names
    assert "layers.0.ffn.gate.tid2eid" in names and "layers.2.ffn.gate.bias" in names
    assert not any(n.startswith("model.") for n in names)


def test_config_reads_legacy_keys(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    new = V4Config.from_dict(cfg)
    assert new.layer_types == (HCA, CSA, SLIDING, CSA)
    assert new.qk_rope_head_dim == 8 and new.compress_rate(0) == 8 and new.compress_rate(1) == 4
    legacy = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types")}
    legacy.pop("rope_parameters")
    legacy.pop("partial_rotary_factor")
    legacy.update(
        compress_ratios=[8, 4, 0, 4], num_hash_layers=2, qk_rope_head_dim=8,
        compress_rates=None, compress_rate_csa=4, compress_rate_hca=8,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64},
    )  # fmt: skip
    with pytest.raises(ValueError, match="compress_ratios"):  # the release's are 0, 4, 128
        V4Config.from_dict(legacy)
    legacy["compress_ratios"] = [128, 4, 0, 4]
    old = V4Config.from_dict(legacy)
    assert old.layer_types == new.layer_types
    assert old.mlp_layer_types == new.mlp_layer_types == ("hash_moe",) * 2 + ("moe",) * 2
    ref_cfg = transformers.DeepseekV4Config(**legacy)
    assert old.rope_compress.rope_type == "yarn" and old.rope_main.rope_type == "default"
    assert old.rope_compress.attention_factor == 1.0
    rot = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(ref_cfg)
    inv, factor = old.rope_compress.inv_freq_and_factor(old.qk_rope_head_dim)
    torch.testing.assert_close(inv, rot.compress_inv_freq)
    assert factor == rot.compress_attention_scaling == 1.0


def test_one_pass_logits_equal_transformers(model, ref, prompts, want):
    got = model.prefill_logits([prompts[0].tolist(), prompts[1, :30].tolist()])  # packed
    assert rel_err(got[0], want[0]) < TOL
    with torch.no_grad():
        want_short = ref(prompts[1:, :30], use_cache=False).logits[0]
    assert rel_err(got[1], want_short) < TOL


def test_indexer_scores_in_slices_of_queries(model, prompts, want, monkeypatch):
    """A long context scores a few queries at a time (`SCORE_BUDGET`): the same logits."""
    from hisparse.models import deepseek_v4

    monkeypatch.setattr(deepseek_v4, "SCORE_BUDGET", 300)  # one query per slice here
    got = model.prefill_logits([prompts[0].tolist()])[0]
    assert rel_err(got, want[0]) < TOL


#: DeepSeek-V4-Flash-Base's config.json as published (legacy keys: ``compress_ratios`` with
#: the MTP layer's trailing entry, ``num_hash_layers``, ``qk_rope_head_dim``, a flat YaRN
#: ``rope_scaling``)
FLASH_BASE = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], bos_token_id=0,
    eos_token_id=1, hc_eps=1e-06, hc_mult=4, hc_sinkhorn_iters=20, head_dim=512,
    hidden_act="silu", hidden_size=4096, index_head_dim=128, index_n_heads=64, index_topk=512,
    max_position_embeddings=1048576, moe_intermediate_size=2048, n_routed_experts=256,
    n_shared_experts=1, norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=6,
    num_hidden_layers=43, num_hash_layers=3, num_key_value_heads=1, num_nextn_predict_layers=1,
    o_groups=8, o_lora_rank=1024, q_lora_rank=1024, qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=16,
                      original_max_position_embeddings=65536, type="yarn"),
    rope_theta=10000, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    sliding_window=128, swiglu_limit=10.0, tie_word_embeddings=False, vocab_size=129280,
    compress_rope_theta=160000, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
)  # fmt: skip


def test_release_config_reads_as_transformers_does():
    cfg = V4Config.from_dict(FLASH_BASE)
    hf = transformers.DeepseekV4Config(**{k: v for k, v in FLASH_BASE.items() if k != "model_type"})
    assert list(cfg.layer_types) == hf.layer_types
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and len(cfg.layer_types) == 43
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim == 64
    rot = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(hf)
    for ours, kind in ((cfg.rope_main, "main"), (cfg.rope_compress, "compress")):
        inv, factor = ours.inv_freq_and_factor(cfg.qk_rope_head_dim)
        torch.testing.assert_close(inv, getattr(rot, f"{kind}_inv_freq"))
        assert factor == getattr(rot, f"{kind}_attention_scaling")
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_main.rope_type == "default"


def test_sync_free_moe_equals_the_routed_loop(model):
    """The MoE form a captured decode step runs (every expert, chosen terms kept) gives the
    per-expert loop's values, hash-routed and score-routed layers alike."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, model.config.hidden_size, generator=g)
    ids = torch.randint(2, 512, (6,), generator=g)
    for layer in (0, 3):  # hash_moe, moe
        moe = model.layers[layer].ffn
        torch.testing.assert_close(moe(x, ids, sync_free=True), moe(x, ids), rtol=1e-6, atol=1e-6)


def test_indexer_choice_matters(model, prompts, want):
    """With every entry selectable the logits move: the test above checks a real top-k."""
    indexers = [b.attn.indexer for b in model.layers if b.attn.indexer is not None]
    old = [ix.topk for ix in indexers]
    try:
        for ix in indexers:
            ix.topk = 64
        got = model.prefill_logits([prompts[0].tolist()])[0]
    finally:
        for ix, k in zip(indexers, old, strict=True):
            ix.topk = k
    assert rel_err(got, want[0]) > 1e-3


def run_chunks(model, prompts: torch.Tensor, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Each request's logits when fed in ``chunks[r]`` pieces, all requests stepping together."""
    cache = model.new_dense_cache(max_reqs=len(chunks), max_len=prompts.shape[1])
    outs: list[list[torch.Tensor]] = [[] for _ in chunks]
    pos = [0] * len(chunks)
    for i in range(max(len(c) for c in chunks)):
        reqs = [r for r, c in enumerate(chunks) if i < len(c)]
        sizes = [chunks[r][i] for r in reqs]
        step = cache.begin_step(reqs, sizes)
        ids = torch.cat([prompts[r, pos[r] : pos[r] + n] for r, n in zip(reqs, sizes, strict=True)])
        logits = model.logits(model(ids, step, cache))
        for r, n, part in zip(reqs, sizes, logits.split(sizes), strict=True):
            outs[r].append(part)
            pos[r] += n
    return [torch.cat(o) for o in outs]


def test_chunked_prefill_and_decode_equal_transformers(model, prompts, want):
    """Chunk ends inside CSA and HCA windows (5, 11, 24, ...), chunks of one token (decode)
    mixed with a prefill chunk of the other request."""
    chunks = [[5, 6, 13, 1, 1, 19], [3, 17, 2, 1, 1, 1, 20]]
    got = run_chunks(model, prompts, chunks)
    for r in range(2):
        assert rel_err(got[r], want[r]) < TOL


def test_greedy_tokens_equal_generate(model, ref, prompts):
    prompt, new = prompts[:1, :20], 25
    with torch.no_grad():
        expect = ref.generate(prompt, max_new_tokens=new, do_sample=False)[0, 20:].tolist()
    cache = model.new_dense_cache(max_reqs=1, max_len=20 + new)
    step = cache.begin_step([0], [20])
    tokens = [int(model.logits(model(prompt[0], step, cache))[-1].argmax())]
    while len(tokens) < new:
        step = cache.begin_step([0], [1])
        out = model.logits(model(torch.tensor(tokens[-1:]), step, cache))
        tokens.append(int(out[-1].argmax()))
    assert tokens == expect


# --- the release's quantized formats --------------------------------------------------------
def _hf_dequant():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)


def test_ue8m0_fp8_dequantize_equals_transformers():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * 3).to(torch.float8_e4m3fn)
    exps = torch.randint(110, 140, (2, 3), generator=g, dtype=torch.int64).to(torch.uint8)
    got = dequantize_tensor(w, exps)
    want = _hf_dequant()._dequantize_one(w, exps, torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:  # the same bytes as torch's e8m0 dtype
        torch.testing.assert_close(dequantize_tensor(w, exps.view(e8m0)), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_tensor(w, exps[:, :2])


def test_fp4_experts_dequantize_equals_transformers():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (3, 64, 48), generator=g, dtype=torch.int64).to(torch.int8)
    exps = torch.randint(115, 135, (3, 64, 3), generator=g, dtype=torch.int64).to(torch.uint8)
    got = dequantize_tensor(packed, exps)
    assert got.shape == (3, 64, 96)
    want = torch.stack(
        [
            _hf_dequant()._dequantize_one(p, s, torch.float32)
            for p, s in zip(packed, exps, strict=True)
        ]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(pack_fp4(unpack_fp4(packed)).view(torch.uint8) & 0x77,
                               packed.view(torch.uint8) & 0x77)  # fmt: skip


def test_make_tiny_cli_writes_what_both_load(tmp_path, capsys):
    from hisparse.cli import main

    out = tmp_path / "v4"
    assert main(["make-tiny", "--arch", "deepseek_v4", "--layers", "3", str(out)]) == 0
    assert "arch deepseek_v4" in capsys.readouterr().out
    model = load_v4_model(out)
    assert model.config.layer_types == (HCA, CSA, SLIDING)
    assert (out / "tokenizer.json").is_file()
    ids = list(range(2, 40))
    want = transformers.DeepseekV4ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expect = want(torch.tensor([ids]), use_cache=False).logits[0]
    assert rel_err(model.prefill_logits([ids])[0], expect) < TOL


def test_loader_reads_the_release_formats(ckpt, tmp_path):
    """fp8 weights with UE8M0 tile scales (``.scale`` beside ``.weight``, the release's names)
    stay e4m3 as `Fp8Linear` layers with the scales as exact fp32 factors (``wo_a``, read as
    grouped weights, is dequantized), 4-bit experts stay packed (`Fp4Linear`: the weights
    transformers' dequantization gives, per call). An `Fp8Linear` computes
    W8A8 (`fp8.w8a8_linear`); before any window closes (no indexer choice to flip) the logits
    stay within its activation rounding of the model with every weight dequantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hisparse.models.fp8_linear import Fp8Linear
    from hisparse.models.v4_quant import Fp4Linear, ue8m0_to_float

    tensors = load_file(ckpt / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    fp8_names = ["layers.1.attn.wq_b.weight", "layers.1.attn.wo_a.weight",
                 "layers.3.ffn.shared_experts.w2.weight"]  # fmt: skip
    fp4_name = "layers.2.ffn.experts.3.w1.weight"
    plain = dict(tensors)
    for name in fp8_names:
        n, k = tensors[name].shape
        amax = tensors[name].abs().amax()
        exp = torch.ceil(torch.log2(amax / 448)).clamp(-20, 20) + 127
        scale = torch.full((-(-n // 128), -(-k // 128)), float(exp)).to(torch.uint8)
        tensors[name] = (plain[name] / ue8m0_to_float(scale)[0, 0]).to(torch.float8_e4m3fn)
        tensors[name[: -len("weight")] + "scale"] = scale
        plain[name] = dequantize_tensor(tensors[name], scale)
    n, k = tensors[fp4_name].shape
    tensors[fp4_name] = torch.randint(-128, 128, (n, k // 2), generator=g).to(torch.int8)
    tensors[fp4_name[: -len("weight")] + "scale"] = torch.randint(
        120, 124, (n, k // 32), generator=g
    ).to(torch.uint8)
    plain[fp4_name] = dequantize_tensor(tensors[fp4_name], tensors[fp4_name[:-6] + "scale"])
    for out, ts in ((tmp_path / "q", tensors), (tmp_path / "plain", plain)):
        out.mkdir()
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(ckpt / name, out / name)
        save_file(ts, out / "model.safetensors")
    model, ref = load_v4_model(tmp_path / "q"), load_v4_model(tmp_path / "plain")
    wq_b = model.get_submodule("layers.1.attn.wq_b")
    assert isinstance(wq_b, Fp8Linear) and wq_b.pow2
    assert torch.equal(wq_b.weight.view(torch.uint8),
                       tensors[fp8_names[0]].view(torch.uint8))  # fmt: skip
    torch.testing.assert_close(
        wq_b.weight_scale_inv, ue8m0_to_float(tensors[fp8_names[0][:-6] + "scale"])
    )
    assert isinstance(model.get_submodule("layers.3.ffn.shared_experts.w2"), Fp8Linear)
    state, want_state = model.state_dict(), ref.state_dict()
    torch.testing.assert_close(state[fp8_names[1]], want_state[fp8_names[1]], rtol=0, atol=0)
    w1 = model.get_submodule(fp4_name[: -len(".weight")])  # 4-bit at rest, dequantized per call
    assert isinstance(w1, Fp4Linear) and w1.weight.dtype == torch.int8
    x = torch.randn(3, w1.in_features, generator=g)
    want_w1 = torch.nn.functional.linear(x, want_state[fp4_name])
    torch.testing.assert_close(w1(x), want_w1, rtol=0, atol=0)
    from hisparse.models import fp8

    x = torch.randn(5, wq_b.in_features, generator=g)
    want_y = fp8.w8a8_linear(x, wq_b.weight, wq_b.weight_scale_inv, pow2=True)
    torch.testing.assert_close(wq_b(x), want_y, rtol=1e-5, atol=1e-5)
    ids = list(range(2, 40))
    got, want = model.prefill_logits([ids])[0], ref.prefill_logits([ids])[0]
    assert torch.isfinite(got).all() and rel_err(got[:3], want[:3]) < 2e-2


def test_a_broken_checkpoint_is_named(ckpt, tmp_path):
    """A tensor missing or of the wrong shape: a `CheckpointError` naming it and what to check."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hisparse.models.checkpoint import CheckpointError

    tensors = load_file(ckpt / "model.safetensors")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(ckpt / name, tmp_path / name)
    missing = {k: v for k, v in tensors.items() if k != "layers.1.attn.indexer.wq_b.weight"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*indexer\.wq_b"):
        load_v4_model(tmp_path)
    tensors["layers.0.attn.wkv.weight"] = tensors["layers.0.attn.wkv.weight"][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight has shape"):
        load_v4_model(tmp_path)
