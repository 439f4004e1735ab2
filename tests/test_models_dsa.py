"""DeepSeek-V3.2 and GLM-5 against transformers' reference forward on tiny random checkpoints.

Checkpoints are written by transformers itself (`make_tiny`), loaded by hisparse's loader, and
run through the paged cache + indexer + sparse MLA path. Exactness tests use fp32 weights,
fp32 KV rows (the test-only 2304 B format) and the exact indexer: the only differences left
are summation orders (absorbed vs expanded MLA, gathered vs masked softmax), ~1e-7 relative
per op, so logits agree to atol 2e-5 (measured ~3e-7 at |logit| ~0.6).

Why not bf16 or fp8 rows here: tiny random models are chaotic. Perturbing the embeddings by
2^-9 relative (bf16 rounding) moves these logits by ~5e-2, because near-tied indexer scores
swap top-k members at the selection boundary; a tolerance loose enough for that would hide
real bugs. Row-format error is bounded at the op level instead (test_attention_reference),
and at model level the quantized formats are checked for placement invariance (bit-identical
logits whatever the block size or block table), which is the property HiSparse relies on.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hisparse.models import CheckpointError, DsaConfig, load_dsa_model
from hisparse.models.deepseek_v32 import Indexer
from hisparse.models.tiny import make_tiny

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_checkpoint):
    arch = request.param
    path = tiny_checkpoint(arch)
    ours = load_dsa_model(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return arch, path, ours, ref


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_schedule(tiny):
    arch, _, ours, ref = tiny
    cfg = ours.config
    assert cfg.index_topk == 16 and cfg.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    if arch == "glm_moe_dsa":
        assert cfg.indexer_full == (True, True, False, True)
        assert ref.config.indexer_types == ["full", "full", "shared", "full"]
        assert ours.model.layers[2].self_attn.indexer is None
    else:
        assert all(cfg.indexer_full)


def test_prefill_batch_matches_transformers(tiny):
    """Prompts shorter than, equal to and longer than index_topk (16), packed in one step."""
    _, _, ours, ref = tiny
    prompts = [_tokens(n, seed) for seed, n in enumerate([3, 16, 17, 45])]
    got = ours.prefill_logits(prompts, block_size=8)
    for p, logits in zip(prompts, got, strict=True):
        torch.testing.assert_close(logits, _ref_logits(ref, p), atol=ATOL, rtol=RTOL)


def test_indexer_selects_what_transformers_selects(tiny):
    """Same top-k sets, layer by layer, for every token (positions <= t only)."""
    _, _, ours, ref = tiny
    ids = _tokens(40, seed=7)
    theirs, mine = [], []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: theirs.append(out[0]))
        for n, m in ref.named_modules()
        if n.endswith("self_attn.indexer") and m is not None
    ]
    hooks += [
        m.register_forward_hook(lambda _m, _i, out: mine.append(out))
        for m in ours.modules()
        if isinstance(m, Indexer)
    ]
    _ref_logits(ref, ids)
    ours.prefill_logits([ids])
    for h in hooks:
        h.remove()
    assert len(theirs) == len(mine) == sum(ours.config.indexer_full)
    for layer_ref, layer_ours in zip(theirs, mine, strict=True):
        for t in range(len(ids)):
            want = {int(p) for p in layer_ref[t] if p <= t}
            have = {int(p) for p in layer_ours[t] if p >= 0}
            assert have == want, (t, sorted(have ^ want))


def test_paged_decode_matches_full_forward(tiny):
    """Chunked prefill mixed with decode, then token-by-token decode of two requests.

    Every logit row produced through the paged cache (block size 4) and sparse attention
    must equal transformers' full-sequence forward at that position.
    """
    _, _, ours, ref = tiny
    seqs = [_tokens(26, seed=11), _tokens(38, seed=12)]
    expected = [_ref_logits(ref, s) for s in seqs]
    cache = ours.new_dense_cache(max_reqs=2, max_len=40, block_size=4)
    done = [0, 0]
    schedule = [({0: 5}), ({0: 1, 1: 9}), ({0: 1, 1: 5})] + [{0: 1, 1: 1}] * 19
    checked = 0
    for plan in schedule:
        reqs = [r for r in plan if done[r] + plan[r] <= len(seqs[r])]
        if not reqs:
            continue
        step = cache.begin_step(reqs, [plan[r] for r in reqs])
        ids = torch.tensor([t for r in reqs for t in seqs[r][done[r] : done[r] + plan[r]]])
        logits = ours.logits(ours(ids, step, cache))
        for r, rows in zip(reqs, logits.split([plan[r] for r in reqs]), strict=True):
            want = expected[r][done[r] : done[r] + plan[r]]
            torch.testing.assert_close(rows, want, atol=ATOL, rtol=RTOL)
            done[r] += plan[r]
            checked += plan[r]
    assert done == [26, 33] and checked == 59


@pytest.mark.parametrize("row_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("indexer_mode", ["exact", "fp8"])
def test_quantized_caches_are_placement_invariant(tiny, row_format, indexer_mode):
    """Where rows sit (block size, block table order) must not change a single bit."""
    _, path, _, _ = tiny
    model = load_dsa_model(path, dtype=torch.float32, indexer_mode=indexer_mode)
    prompts = [_tokens(21, seed=3), _tokens(9, seed=4)]

    def run(block_size: int, shuffle: bool) -> torch.Tensor:
        cache = model.new_dense_cache(
            max_reqs=2, max_len=24, block_size=block_size, row_format=row_format
        )
        if shuffle:
            perm = torch.randperm(
                cache.block_table.numel(), generator=torch.Generator().manual_seed(5)
            )
            cache.block_table = (cache.block_table.flatten()[perm]).view_as(cache.block_table)
        out = []
        step = cache.begin_step([0, 1], [16, 9])
        ids = torch.tensor(prompts[0][:16] + prompts[1])
        out.append(model.logits(model(ids, step, cache)))
        for t in range(16, 21):
            step = cache.begin_step([0], [1])
            out.append(model.logits(model(torch.tensor([prompts[0][t]]), step, cache)))
        return torch.cat(out)

    base = run(4, False)
    assert torch.isfinite(base).all()
    assert torch.equal(base, run(8, False))
    assert torch.equal(base, run(4, True))
    if indexer_mode == "fp8":
        assert model.indexer_format.row_bytes == 64 + 4  # tiny index_head_dim 64, one scale


def test_yarn_rope_matches_transformers(tmp_path):
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    path = make_tiny("deepseek_v32", tmp_path, num_hidden_layers=2, rope_parameters=rope)
    cfg = DsaConfig.from_pretrained(path)
    assert cfg.rope.rope_type == "yarn" and cfg.softmax_scale != cfg.qk_head_dim**-0.5
    ours = load_dsa_model(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _tokens(40, seed=9)
    torch.testing.assert_close(
        ours.prefill_logits([ids])[0], _ref_logits(ref, ids), atol=ATOL, rtol=RTOL
    )


# --- loader ---------------------------------------------------------------------------------
def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    _, _, ours, ref = tiny
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    other = load_dsa_model(tmp_path, dtype=torch.float32)
    a, b = _state(ours), _state(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rewrite(src, dst, edit) -> None:
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file(edit(tensors), dst / "model.safetensors")


def test_fused_experts_load_like_per_expert_tensors(tiny, tmp_path):
    """transformers' fused 3-D experts load like per-expert tensors (the MTP layer:
    tests/test_fp8_model.py)."""
    _, path, ours, _ = tiny
    cfg = ours.config

    def fuse(t: dict) -> dict:
        out = dict(t)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts"
            if f"{p}.0.gate_proj.weight" not in t:
                continue
            e = range(cfg.n_routed_experts)
            gate_up = [
                torch.cat([t[f"{p}.{j}.gate_proj.weight"], t[f"{p}.{j}.up_proj.weight"]]) for j in e
            ]
            out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{p}.down_proj"] = torch.stack([t[f"{p}.{j}.down_proj.weight"] for j in e])
            for j in e:
                for w in ("gate_proj", "up_proj", "down_proj"):
                    del out[f"{p}.{j}.{w}.weight"]
        return out

    _rewrite(path, tmp_path, fuse)
    other = load_dsa_model(tmp_path, dtype=torch.float32)
    a, b = _state(ours), _state(other)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style 128x128 block quantization of a 2-D weight (the test's own encoder)."""
    o, i = w.shape
    bo, bi = -(-o // 128), -(-i // 128)
    padded = torch.zeros(bo * 128, bi * 128)
    padded[:o, :i] = w
    tiles = padded.view(bo, 128, bi, 128)
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(bo * 128, bi * 128)
    return q[:o, :i].contiguous(), scale


def test_fp8_block_scaled_weights_are_dequantized(tiny, tmp_path):
    _, path, _, _ = tiny
    quantized = {}

    def quantize(t: dict) -> dict:
        out = dict(t)
        for k, v in t.items():
            if k.endswith("proj.weight") and v.dim() == 2 and "weights_proj" not in k:
                out[k], out[k + "_scale_inv"] = _fp8_blocks(v)
                quantized[k] = (
                    out[k].float()
                    * out[k + "_scale_inv"]
                    .repeat_interleave(128, 0)
                    .repeat_interleave(128, 1)[: v.shape[0], : v.shape[1]]
                )
        return out

    _rewrite(path, tmp_path, quantize)
    model = load_dsa_model(tmp_path, dtype=torch.float32, fp8_weights="dequantize")
    state = model.state_dict()
    assert len(quantized) > 20
    for k, want in quantized.items():
        assert torch.equal(state[k], want), k
    assert torch.isfinite(model.prefill_logits([_tokens(20, seed=1)])[0]).all()


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    _, path, _, _ = tiny
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    _rewrite(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_dsa_model(tmp_path / "missing", dtype=torch.float32)

    _rewrite(path, tmp_path / "shape", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight has shape"):
        load_dsa_model(tmp_path / "shape", dtype=torch.float32)

    _rewrite(
        path, tmp_path / "extra", lambda t: {**t, "model.layers.0.mystery.weight": t[name].clone()}
    )
    with pytest.raises(CheckpointError, match=r"mystery\.weight"):
        load_dsa_model(tmp_path / "extra", dtype=torch.float32)

    def no_scale(t: dict) -> dict:
        return {**t, name: t[name].to(torch.float8_e4m3fn)}

    _rewrite(path, tmp_path / "noscale", no_scale)
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight_scale_inv is missing"):
        load_dsa_model(tmp_path / "noscale", dtype=torch.float32)


def test_bf16_load_keeps_router_and_indexer_heads_fp32(tiny):
    _, path, _, _ = tiny
    model = load_dsa_model(path, dtype=torch.bfloat16)
    state = model.state_dict()
    assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert state["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    logits = model.prefill_logits([_tokens(20, seed=2)], row_format="bf16")[0]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_config_json_is_what_transformers_wrote(tiny):
    _, path, ours, ref = tiny
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == ours.config.arch
    assert ref.config.num_hidden_layers == ours.config.num_hidden_layers


def test_v32_attention_preset_keeps_real_attention_dims():
    from hisparse.models.tiny import tiny_config_kwargs

    kw = tiny_config_kwargs("deepseek_v32", "v32-attention")
    cfg = DsaConfig.from_dict({"model_type": "deepseek_v32", **kw})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank) == (7168, 128, 1536)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim) == (512, 64, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.num_hidden_layers == 2 and cfg.n_routed_experts == 8
    glm = tiny_config_kwargs("glm_moe_dsa", "v32-attention")
    assert (glm["index_n_heads"], glm["kv_lora_rank"], glm["v_head_dim"]) == (32, 512, 256)


def test_make_tiny_without_transformers_says_so(tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from hisparse.models.tiny import make_tiny\n"
        f"make_tiny('deepseek_v32', {str(tmp_path)!r})\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    assert "transformers, which is not installed" in res.stderr


def test_cache_handle_fits_the_attention_protocol():
    """The engine plugs HiSparse's CacheHandle in where DenseDsaCache layers go."""
    from hisparse.models.kv_access import SparseMlaLayerCache
    from hisparse.runtime.cache_handle import CacheHandle

    assert issubclass(CacheHandle, SparseMlaLayerCache)


def test_release_configs_parse_and_agree_with_the_cache_planner():
    """Real-release config.json shapes (legacy rope_scaling, IndexShare keys) parse, and the
    model's indexer schedule is the one the KV layout planner plans caches for."""
    from hisparse.kv.cache_shapes import cache_shape_from_hf_config

    v32 = {
        "model_type": "deepseek_v32",
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    cfg = DsaConfig.from_dict(v32)
    assert cfg.num_hidden_layers == 61 and cfg.mlp_layer_types[:4] == ("dense",) * 3 + ("sparse",)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    _, factor = cfg.rope.inv_freq_and_factor(64)
    assert factor == pytest.approx(1.0)  # mscale == mscale_all_dim
    glm = {"model_type": "glm_moe_dsa", "index_topk_freq": 4, "index_skip_topk_offset": 3}
    for raw in (v32, glm):
        cfg = DsaConfig.from_dict(raw)
        shape = cache_shape_from_hf_config(raw)
        planned = [s.name for s in shape.indexer_specs]
        assert planned == [f"layers.{i}.indexer" for i, f in enumerate(cfg.indexer_full) if f]
        leaders = [s.index_leader for s in shape.sparse_specs]
        assert leaders == [f"layers.{cfg.index_leader(i)}.attn" for i in range(len(leaders))]
    assert sum(DsaConfig.from_dict(glm).indexer_full) == 21
