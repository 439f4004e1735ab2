"""`OutputProcessor`: the incrementally decoded ``req.text`` equals the full decode
(``tokenizer.decode(output_token_ids, skip_special_tokens=True)``) after every token, on
SmolLM2's tokenizer and on byte-level BPE, SentencePiece-style (Metaspace) and Llama-2-style
(byte fallback) tokenizers built here; and the stopping rules (stop token ids, EOS,
``ignore_eos``, stop strings, ``min_tokens``, ``max_tokens``, ``max_model_len``), logprobs
and metrics as the engine's full-re-decoding ``StopChecker`` had them, written out below
from the full decode (`reference`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from hisparse.engine.output_processor import DetokenizerState, OutputProcessor
from hisparse.engine.request import Request, Status
from hisparse.engine.sampling_params import SamplingParams

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog, naïve café déjà vu. "
    "你好，世界。这是一个测试。 日本語のテキスト。 😀🎉👩‍👩‍👧 emoji 🚀 and ∑∫√ maths "
    "  two  spaces, tabs\tand\nnew lines\n\n```python\nprint('x')\n```\n"
)
#: English only: the tokenizers built here split words into pieces, and characters outside
#: it (CJK, emoji) become byte tokens (byte-level, byte fallback) or ``<unk>`` (Metaspace)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. Whatever you are, be a good one. The only thing we have to fear is fear "
    "itself. It was the best of times, it was the worst of times, it was the age of wisdom, "
    "it was the age of foolishness. Call me Ishmael. In the beginning was the word.",
    "def main():\n    print('hello, world')\n    return 0\n\nif __name__ == '__main__':\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9, punctuation ! ? ; : ( ) [ ] { } - _ + = * / & % $ # @ ~",
]


def _trained(pre: Any, dec: Any, vocab_size: int) -> Tokenizer:
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre
    tk.decoder = dec
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(dec, decoders.ByteLevel) else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 3, trainer)
    tk.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tk


def byte_level_bpe() -> Tokenizer:
    """GPT-2-style: every byte is a token, merges cross character boundaries."""
    return _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 400)


def metaspace_bpe() -> Tokenizer:
    """SentencePiece-style: ``▁`` marks a space, the decode strips the first one."""
    return _trained(pre_tokenizers.Metaspace(), decoders.Metaspace(), 200)


def llama2_style() -> Tokenizer:
    """Llama 2's decoder (Replace ▁, ByteFallback, Fuse, Strip): characters outside the
    vocabulary are ``<0xXX>`` byte tokens, a run of which decodes as one."""
    base = metaspace_bpe()
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tk.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tk


def wordpiece() -> Tokenizer:
    """A decoder that is not local (``##`` joins, space clean-up): decoded whole each step."""
    tk = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False
    )
    tk.train_from_iterator(CORPUS * 3, trainer)
    return tk


@dataclass
class Tok:
    """A tokenizer under test: what the processor is given, the ids a stream draws from, its
    special ids, and whether it should decode incrementally."""

    tokenizer: Any
    vocab_size: int
    specials: list[int]
    incremental: bool

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        out = self.tokenizer.encode(text, add_special_tokens=False)
        return out if isinstance(out, list) else out.ids


def _local(tk: Tokenizer, incremental: bool) -> Tok:
    specials = [i for s in SPECIALS if (i := tk.token_to_id(s)) is not None]
    return Tok(tk, tk.get_vocab_size(with_added_tokens=True), specials, incremental)


def _transformers(clean_up: bool) -> Tok:
    transformers = pytest.importorskip("transformers")
    tk = byte_level_bpe()
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, clean_up_tokenization_spaces=clean_up
    )
    return Tok(
        wrapped, tk.get_vocab_size(with_added_tokens=True), _local(tk, True).specials, not clean_up
    )


def _smollm2() -> Tok:
    from hisparse.models.smollm2 import smollm2_gguf_path
    from hisparse.models.tokenizer import GgufTokenizer

    try:
        path = smollm2_gguf_path()
    except Exception as e:  # the model package is optional
        pytest.skip(f"SmolLM2 is not installed: {e}")
    tk = GgufTokenizer.from_gguf(path)
    return Tok(tk, tk.vocab_size, sorted(tk.special_ids), True)


BUILDERS = {
    "smollm2": _smollm2,
    "byte_level": lambda: _local(byte_level_bpe(), True),
    "metaspace": lambda: _local(metaspace_bpe(), True),
    "llama2": lambda: _local(llama2_style(), True),
    "transformers": lambda: _transformers(clean_up=False),
    "transformers_clean_up": lambda: _transformers(clean_up=True),  # decoded whole
    "wordpiece": lambda: _local(wordpiece(), False),  # decoded whole
}
_built: dict[str, Tok] = {}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tok(request: pytest.FixtureRequest) -> Tok:
    if request.param not in _built:
        _built[request.param] = BUILDERS[request.param]()
    return _built[request.param]


# --- the reference: the old StopChecker's rules, on the full decode --------------------------


def common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Outcome:
    steps: int  # tokens appended when it finished (or all of them)
    reason: str | None
    text: str
    stop_reason: str | int | None


def reference(
    tok: Tok | None,
    ids: list[int],
    params: SamplingParams,
    eos: set[int],
    max_model_len: int,
    prompt_len: int = 1,
) -> Outcome:
    """What the engine's ``StopChecker`` (the full re-decode) decided, step by step. One
    difference: stop strings are searched from where the text changed, which is where it
    ended before (the old rule) unless a trailing U+FFFD became a character."""
    text = ""
    for k in range(1, len(ids) + 1):
        token = ids[k - 1]
        before, text = text, (tok.decode(ids[:k]) if tok is not None else "")
        if k >= params.min_tokens:
            if token in params.stop_token_ids:
                return Outcome(k, "stop", text, token)
            if not params.ignore_eos and token in eos:
                return Outcome(k, "stop", text, None)
            if params.stop:
                start = max(common_prefix_len(before, text) - max(map(len, params.stop)) + 1, 0)
                hits = [(i, s) for s in params.stop if (i := text.find(s, start)) >= 0]
                if hits:
                    cut, s = min(hits)
                    return Outcome(k, "stop", text[:cut], s)
        if (params.max_tokens is not None and k >= params.max_tokens) or (
            prompt_len + k >= max_model_len
        ):
            return Outcome(k, "length", text, None)
    return Outcome(len(ids), None, text, None)


def run(
    proc: OutputProcessor,
    tok: Tok | None,
    ids: list[int],
    params: SamplingParams,
    prompt_len: int = 1,
) -> tuple[Outcome, Request]:
    """Feed ``ids`` until the request ends; the text equals the full decode at every step
    (until a stop string cuts it), and an incremental state never has to restart."""
    req = Request("r", [0] * prompt_len, params)
    reason = None
    for k, t in enumerate(ids, start=1):
        reason = proc.append(req, t, None, float(k))
        if k == 1:
            state = req.detokenizer
        assert req.detokenizer is state
        if not (reason == "stop" and isinstance(req.stop_reason, str)):  # not cut
            assert req.text == (tok.decode(ids[:k]) if tok is not None else ""), ids[:k]
        if reason is not None:
            return Outcome(k, reason, req.text, req.stop_reason), req
    return Outcome(len(ids), None, req.text, req.stop_reason), req


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": None, **kw})


def realistic(tok: Tok) -> list[int]:
    """TEXT's tokens with special tokens between them (skipped by the decode)."""
    ids = tok.encode(TEXT + TEXT.upper())
    out: list[int] = []
    for i, t in enumerate(ids):
        out.append(t)
        if i % 17 == 5 and tok.specials:
            out.append(tok.specials[i % len(tok.specials)])
    return out


# --- the text ----------------------------------------------------------------------------------


def test_text_equals_the_full_decode_at_every_step(tok: Tok) -> None:
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    assert proc.incremental is tok.incremental
    ids = realistic(tok)
    outcome, req = run(proc, tok, ids, greedy())
    assert outcome.text == tok.decode(ids) and outcome.reason is None
    if tok.incremental:  # the window stays a few tokens long on valid text
        state = req.detokenizer
        assert isinstance(state, DetokenizerState)
        assert len(ids) - state.prefix <= 12


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_token_streams_decode_as_the_whole(tok: Tok, data: st.DataObject) -> None:
    """Any ids (invalid UTF-8, lone byte tokens, specials, added tokens) and pieces of real
    text with random ids among them."""
    real = realistic(tok)
    start = data.draw(st.integers(0, len(real) - 1))
    piece = real[start : start + 40]
    noise = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(
        st.one_of(
            st.lists(noise, min_size=1, max_size=40),
            st.lists(st.one_of(st.sampled_from(piece), noise), min_size=1, max_size=40),
            st.just(piece),
        )
    )
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    outcome, _ = run(proc, tok, ids, greedy())
    assert outcome.text == tok.decode(ids)


def test_multi_byte_characters_split_over_tokens() -> None:
    tok = _local(byte_level_bpe(), True)
    ids = tok.encode("a😀b你c")
    assert len(ids) >= 8  # each of the emoji's 4 bytes and the CJK's 3 bytes a token
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    req = Request("r", [0], greedy())
    texts = []
    for t in ids:
        proc.append(req, t, None, 0.0)
        texts.append(req.text)
        assert req.text == tok.decode(req.output_token_ids)
    assert "a\ufffd" in texts and texts[-1] == "a😀b你c"


def test_byte_fallback_run_that_turns_invalid() -> None:
    """``<0x41>`` alone decodes to ``A``; followed by ``<0xC3>`` and a normal token the run
    is invalid and both bytes decode to U+FFFD: text already shown changes."""
    tk = llama2_style()
    tok = _local(tk, True)
    ids = [tk.token_to_id(t) for t in ("▁the", "<0x41>", "<0x42>", "<0xC3>", "▁the")]
    proc = OutputProcessor(tk, set(), 1 << 30)
    outcome, _ = run(proc, tok, ids, greedy())
    assert outcome.text == tok.decode(ids) == "the\ufffd\ufffd\ufffd the"


def test_a_metaspace_first_token_loses_its_space_only_at_the_start() -> None:
    tk = metaspace_bpe()
    tok = _local(tk, True)
    the, unk = tk.token_to_id("▁the"), tk.token_to_id("<unk>")
    for ids in ([the, the], [unk, the, the], [the, unk, the], [the, unk, unk, the, unk]):
        outcome, _ = run(OutputProcessor(tk, set(), 1 << 30), tok, ids, greedy())
        assert outcome.text == tok.decode(ids)


def test_state_survives_preemption_and_restarts_when_the_tokens_change() -> None:
    tok = _local(byte_level_bpe(), True)
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    ids = realistic(tok)
    half = len(ids) // 2
    _, req = run(proc, tok, ids[:half], greedy())
    state = req.detokenizer
    # preemption frees the KV and recomputes; the output tokens and text stay
    req.status, req.num_computed = Status.WAITING, 0
    for k in range(half, len(ids)):
        proc.append(req, ids[k], None, 0.0)
        assert req.text == tok.decode(ids[: k + 1])
    assert req.detokenizer is state
    # tokens taken away elsewhere, or the state lost: decoded afresh
    del req.output_token_ids[half:]
    proc.append(req, ids[half], None, 0.0)
    assert req.text == tok.decode(ids[: half + 1])
    req.detokenizer = None
    proc.append(req, ids[half + 1], None, 0.0)
    assert req.text == tok.decode(ids[: half + 2])
    # the text replaced elsewhere, or a window no longer fitting its context: afresh too
    req.text = "#" * len(req.text)  # the same length
    proc.append(req, ids[half + 2], None, 0.0)
    assert req.text == tok.decode(ids[: half + 3])
    assert isinstance(req.detokenizer, DetokenizerState)
    req.detokenizer.prefix_text = "not the context"
    proc.append(req, ids[half + 3], None, 0.0)
    assert req.text == tok.decode(ids[: half + 4])


def test_a_text_held_elsewhere_never_changes() -> None:
    """``req.text`` grows in place only while nothing else holds it: the texts a streaming
    client took stay as they were."""
    tok = _local(byte_level_bpe(), True)
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    ids = realistic(tok)
    req = Request("r", [0], greedy())
    held = []
    for t in ids:
        proc.append(req, t, None, 0.0)
        held.append(req.text)
    assert held == [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]


# --- stopping ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stopping_matches_the_full_decode_rules(tok: Tok, data: st.DataObject) -> None:
    real = realistic(tok)
    start = data.draw(st.integers(0, len(real) - 1))
    ids = real[start : start + 60]
    full = tok.decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full:
            i = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[i : i + data.draw(st.integers(1, 6))])
        else:
            stops.append("never")
    params = greedy(
        stop=stops,
        stop_token_ids=data.draw(st.lists(st.sampled_from(ids), max_size=2)),
        ignore_eos=data.draw(st.booleans()),
        min_tokens=data.draw(st.integers(0, 20)),
        max_tokens=data.draw(st.one_of(st.none(), st.integers(20, 80))),
    )
    eos = set(data.draw(st.lists(st.sampled_from(ids), max_size=1)))
    max_model_len = data.draw(st.integers(10, 100))
    prompt_len = 5
    want = reference(tok, ids, params, eos, max_model_len, prompt_len)
    got, req = run(OutputProcessor(tok.tokenizer, eos, max_model_len), tok, ids, params, prompt_len)
    assert got == want
    assert req.output_token_ids == ids[: got.steps]


def test_a_stop_string_across_tokens_cuts_the_text_before_it() -> None:
    tok = _local(byte_level_bpe(), True)
    ids = tok.encode("Hello world! The quick brown fox")
    stop = "d! Th"  # it spans four tokens
    params = greedy(stop=[stop, "never seen"])
    got, _ = run(OutputProcessor(tok.tokenizer, set(), 1 << 30), tok, ids, params)
    assert got == Outcome(got.steps, "stop", "Hello worl", stop)
    pieces = [tok.decode([i]) for i in ids[got.steps - 4 : got.steps]]
    assert pieces == ["ld", "!", " ", "The"]


def test_a_stop_string_ending_in_a_character_completed_later() -> None:
    """``b😀``: after ``ab`` and the emoji's first bytes the text is ``ab\\ufffd``; the
    token that completes it changes no length, and the stop string starts before it (the
    old rule, searching from the old length less ``len(stop) - 1``, missed it)."""
    tk = byte_level_bpe()
    tok = _local(tk, True)
    ids = tok.encode("ab") + tok.encode("😀")
    params = greedy(stop=["b😀"])
    want = reference(tok, ids, params, set(), 1 << 30)
    got, _ = run(OutputProcessor(tk, set(), 1 << 30), tok, ids, params)
    assert got == want == Outcome(len(ids), "stop", "a", "b😀")


def test_stop_token_eos_ignore_eos_and_min_tokens() -> None:
    tok = _local(byte_level_bpe(), True)
    ids = tok.encode("Hello world! The quick brown fox")
    eos = {ids[3]}
    proc = OutputProcessor(tok.tokenizer, eos, 1 << 30)
    assert run(proc, tok, ids, greedy())[0].steps == 4  # EOS, no stop_reason
    assert run(proc, tok, ids, greedy())[0].stop_reason is None
    assert run(proc, tok, ids, greedy(ignore_eos=True))[0].reason is None
    got = run(proc, tok, ids, greedy(stop_token_ids=[ids[2]]))[0]
    assert (got.steps, got.reason, got.stop_reason) == (3, "stop", ids[2])
    assert run(proc, tok, ids, greedy(min_tokens=6))[0].reason is None  # EOS only before 6
    # a stop string wholly before min_tokens is not found later either
    got = run(proc, tok, ids, greedy(stop=["Hel"], min_tokens=6, ignore_eos=True))[0]
    assert got.reason is None


def test_length_at_max_tokens_and_max_model_len() -> None:
    tok = _local(byte_level_bpe(), True)
    ids = tok.encode("Hello world! The quick brown fox")
    got, req = run(OutputProcessor(tok.tokenizer, set(), 1 << 30), tok, ids, greedy(max_tokens=5))
    assert (got.steps, got.reason, len(req.output_token_ids)) == (5, "length", 5)
    got, _ = run(OutputProcessor(tok.tokenizer, set(), 10), tok, ids, greedy(), prompt_len=3)
    assert (got.steps, got.reason) == (7, "length")


def test_logprobs_and_metrics() -> None:
    tok = _local(byte_level_bpe(), True)
    proc = OutputProcessor(tok.tokenizer, set(), 1 << 30)
    req = Request("r", [0], greedy(logprobs=1))
    steps = [(5, {5: -0.5, 7: -1.0}), (7, {5: -0.25, 9: -2.0}), (9, {9: -1.5})]
    for t, (tid, lp) in enumerate(steps):
        proc.append(req, tid, lp, 10.0 + t)
    assert req.logprobs == [lp for _, lp in steps]
    assert req.cumulative_logprob == pytest.approx(-0.5 + 0.0 + -1.5)  # 7 not in its dict
    assert req.metrics.first_token == 10.0 and req.metrics.token_times == [10.0, 11.0, 12.0]
    plain = Request("p", [0], greedy())
    proc.append(plain, 5, {5: -0.5}, 1.0)
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_no_tokenizer_keeps_no_text() -> None:
    proc = OutputProcessor(None, {2}, 1 << 30)
    assert not proc.incremental
    got, req = run(proc, None, [5, 6, 2, 7], greedy(stop=["x"]))
    assert (got.steps, got.reason, req.text) == (3, "stop", "")
