"""SmolLM2-135M-Instruct (the bundled GGUF) against transformers on the same file, and the paged
sparse path on real weights.

transformers loads the GGUF itself (``from_pretrained(dir, gguf_file=name)``; it dequantizes
with its own kernels and undoes llama.cpp's Q/K permutation its own way), so agreement checks
our GGUF reading, permutation, RoPE, GQA and tokenizer independently. Everything runs in fp32.
Real weights matter: HiSparse's published failures passed random-weight tests.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
from hisparse.models.gguf_loader import load_llama_gguf, read_gguf
from hisparse.models.smollm2 import smollm2_gguf_path
from hisparse.models.tokenizer import GgufTokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
NEW_TOKENS = 20
#: A prose passage several times longer than the sparse budgets used below.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a can "
    "of oil, a cloth, and a small notebook in which he wrote the weather, the ships he saw, and "
    "the number of gulls on the rail. In winter the storms came from the north and the glass "
    "rattled in its frame; in summer the fog rolled in so thick that he could not see the rocks "
    "below. His daughter, who lived in the village across the bay, sent him letters with the "
    "mail boat on Thursdays. She wrote about the market, the school, and the new bridge that "
    "the council had promised for years. "
)


@pytest.fixture(scope="module")
def gguf_file():
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return read_gguf(path)


@pytest.fixture(scope="module")
def ours(gguf_file):
    return load_llama_gguf(gguf_file, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(gguf_file):
    return GgufTokenizer.from_gguf(gguf_file)


@pytest.fixture(scope="module")
def ref_tok(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(
        gguf_file.path.parent, gguf_file=gguf_file.path.name
    )


@pytest.fixture(scope="module")
def ref_model(gguf_file):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.path.parent, gguf_file=gguf_file.path.name, dtype=torch.float32
    ).eval()


def test_config_from_metadata(ours):
    cfg = ours.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.max_position_embeddings == 8192 and cfg.vocab_size == 49152
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert cfg.row_format("bf16").row_bytes == 768 and cfg.row_format("fp32").row_bytes == 1536


def test_weights_equal_transformers(ours, ref_model):
    """Same dequantized values and the same Q/K row order as transformers' GGUF loader."""
    a, b = ours.state_dict(), ref_model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_greedy_matches_transformers_generate(ours, tok, ref_tok, ref_model):
    """top_k at least the context length: token for token what transformers generates."""
    prompts = [tok.encode_chat(c) for c in CHATS]
    for chat, ids in zip(CHATS, prompts, strict=True):
        want = ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(chat) == want
        assert ids == ref_tok(want, add_special_tokens=False)["input_ids"]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = ref_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            expected.append(out[0, len(ids) :].tolist())
    ours.set_indexer(top_k=ours.config.max_position_embeddings)
    try:
        got = ours.generate_greedy(prompts, NEW_TOKENS, stop_ids=tok.stop_token_ids)
    finally:
        ours.set_indexer(GqaIndexerConfig())
    assert got == expected, [tok.decode(g) for g in got]
    assert "Paris" in tok.decode(expected[0])


TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Numbers: 3.14159, 2024-11-29, 1,000,000 and 42nd.",
    "Ünïcödé: café, naïve, 東京, emoji 🚀, Ελληνικά.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x ** 2  # square",
    PASSAGE,
]


def test_tokenizer_matches_transformers(tok, ref_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref_tok(text, add_special_tokens=True)["input_ids"], text
        assert tok.decode(ids) == ref_tok.decode(ids) == text
    specials = [tok.bos_token_id, tok.eos_token_id]
    assert (tok.bos_token, tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)
    assert tok.decode([*specials, 100], skip_special_tokens=True) == ref_tok.decode(
        [*specials, 100], skip_special_tokens=True
    )


def test_chat_template_variants_match_transformers(tok, ref_tok):
    chat = [*CHATS[2], {"role": "assistant", "content": "Rayleigh scattering."}]
    for gen in (True, False):
        want = ref_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(chat, add_generation_prompt=gen) == want


def _passage_ids(tok, n_tokens: int) -> list[int]:
    ids = tok.encode(PASSAGE * (1 + n_tokens // 100), add_special_tokens=False)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def test_paged_decode_matches_full_forward(ours, tok):
    """Chunked prefill + token-by-token decode through 4-token blocks == one full forward."""
    seqs = [_passage_ids(tok, 30), tok.encode_chat(CHATS[1])[:24]]
    full = ours.prefill_logits(seqs)
    cache = ours.new_dense_cache(max_reqs=2, max_len=32, block_size=4)
    done = [0, 0]
    schedule = [{0: 7}, {0: 1, 1: 11}, {0: 5, 1: 1}] + [{0: 1, 1: 1}] * 17
    checked = 0
    for plan in schedule:
        reqs = [r for r in plan if done[r] + plan[r] <= len(seqs[r])]
        if not reqs:
            continue
        step = cache.begin_step(reqs, [plan[r] for r in reqs])
        ids = torch.tensor([t for r in reqs for t in seqs[r][done[r] : done[r] + plan[r]]])
        logits = ours.logits(ours(ids, step, cache))
        for r, rows in zip(reqs, logits.split([plan[r] for r in reqs]), strict=True):
            want = full[r][done[r] : done[r] + plan[r]]
            torch.testing.assert_close(rows, want, atol=2e-4, rtol=1e-4)
            done[r] += plan[r]
            checked += plan[r]
    assert done == [30, 24] and checked == 54


@pytest.mark.parametrize("method", ["fp8", "quest", "lowrank"])
def test_sparse_topk_is_placement_invariant(ours, tok, method):
    """Prompts longer than top_k: the sparse path runs, stays sensible, and block size or
    block-table order changes no bit of the logits."""
    cfg = GqaIndexerConfig(top_k=32, method=method, sink_tokens=4, recent_window=16)
    ours.set_indexer(cfg)
    try:
        prompt = [1, *_passage_ids(tok, 63)]
        other = tok.encode_chat(CHATS[0])

        def run(block_size: int, shuffle: bool) -> tuple[torch.Tensor, list[int]]:
            cache = ours.new_dense_cache(max_reqs=2, max_len=72, block_size=block_size)
            if shuffle:
                perm = torch.randperm(
                    cache.block_table.numel(), generator=torch.Generator().manual_seed(5)
                )
                cache.block_table = cache.block_table.flatten()[perm].view_as(cache.block_table)
            step = cache.begin_step([0, 1], [len(prompt), len(other)])
            hidden = ours(torch.tensor(prompt + other), step, cache)
            logits = [ours.logits(hidden[[len(prompt) - 1, -1]])]
            toks = [int(logits[0][0].argmax())]
            for _ in range(3):
                step = cache.begin_step([0], [1])
                logits.append(ours.logits(ours(torch.tensor(toks[-1:]), step, cache)))
                toks.append(int(logits[-1][0].argmax()))
            return torch.cat(logits), toks

        base, toks = run(16, False)
        assert torch.isfinite(base).all()
        again, toks2 = run(32, True)
        assert toks2 == toks and torch.equal(again, base)
        # Still the model: the sparse next token is among dense attention's top candidates.
        ours.set_indexer(GqaIndexerConfig())
        dense = ours.prefill_logits([prompt])[0][-1]
        assert toks[0] in dense.topk(5).indices.tolist()
    finally:
        ours.set_indexer(GqaIndexerConfig())


def test_sparse_selection_uses_the_budget(ours, tok):
    """With top_k < context the layer reads exactly top_k rows per token (sinks + window +
    indexer choice), and a top_k of at least the length is dense."""
    from hisparse.models.llama_attention import LlamaAttention

    prompt = _passage_ids(tok, 70)
    seen = []
    attn = ours.model.layers[3].self_attn
    assert isinstance(attn, LlamaAttention)
    orig = attn._select

    def spy(*a, **kw):
        out = orig(*a, **kw)
        seen.append(out)
        return out

    attn._select = spy
    try:
        ours.set_indexer(top_k=32, recent_window=8)
        ours.prefill_logits([prompt])
        ours.set_indexer(top_k=70)
        ours.prefill_logits([prompt])
    finally:
        attn._select = orig
        ours.set_indexer(GqaIndexerConfig())
    sparse, dense = seen
    counts = (sparse >= 0).sum(-1)
    pos = torch.arange(70)
    assert torch.equal(counts, torch.clamp(pos + 1, max=32))
    for t in (40, 69):
        row = set(sparse[t][sparse[t] >= 0].tolist())
        assert {0, 1, 2, 3} | set(range(t - 7, t + 1)) <= row and max(row) == t
    assert torch.equal((dense >= 0).sum(-1), pos + 1)


def test_bf16_model_and_rows(ours, tok):
    """The serving dtype: bf16 weights and 768 B bf16 rows, dense and sparse, still answer."""
    import copy

    model = copy.deepcopy(ours).to(torch.bfloat16)
    ids = tok.encode_chat(CHATS[0])
    # top_k 24 < the 37-token prompt: its first 24 tokens attend densely, the rest sparsely.
    model.set_indexer(GqaIndexerConfig(top_k=24, recent_window=16))
    cache = model.new_dense_cache(max_reqs=1, max_len=len(ids) + 8)
    assert cache.row_format.row_bytes == 768 and cache.kv[0].shape[-1] == 768
    out = model.generate_greedy([ids], 8, cache=cache)[0]
    assert "Paris" in tok.decode(out), tok.decode(out)
