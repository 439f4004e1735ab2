"""vLLM's output shape and sampling options: ``RequestOutput.outputs[i]``, ``n``,
``logprobs``, ``min_tokens``, the repetition / presence / frequency penalties, stop strings,
seeds, ``LLM.chat``; the defaults that must work for any checkpoint (``kv_format="auto"``,
``dtype``, ``max_model_len``); Ctrl-C in ``hisparse generate``. On a tiny DSA checkpoint
(with a word-level tokenizer and a chat template written beside it) and on the bundled
SmolLM2; the sampler's semantics on hand-made logits."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math
import shutil

import pytest
import torch

import hisparse
from api_helpers import add_tokenizer, prompts, tiny_llm
from hisparse import LLM, CompletionOutput, HiSparseConfig, RequestOutput, SamplingParams
from hisparse.engine.sampling import (
    PenaltyState,
    _Row,
    _top_logprobs,
    logprob_rows,
    process_logits,
    sample_rows,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint):
    """The ``make-tiny`` default checkpoint (164-byte fp8 rows), with a tokenizer."""
    out = tmp_path_factory.mktemp("v32")
    shutil.copytree(tiny_checkpoint("deepseek_v32"), out, dirs_exist_ok=True)
    add_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def llm(checkpoint):
    # all-GPU placement: the process's one host pool stays free for the engines built below
    with tiny_llm(checkpoint, kv_placement="gpu") as engine:
        yield engine


# --- the sampler ------------------------------------------------------------------------------


def _row(params, prompt=(), output=()):
    return _Row(params, None, list(prompt), list(output))


def test_penalties_follow_vllm():
    """Repetition divides a positive logit and multiplies a negative one of every token of
    prompt or output; presence and frequency subtract per output token only."""
    raw = torch.tensor([[3.0, -1.0, 2.0, 0.5, 1.0]])
    rep = _row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert process_logits(raw, [rep]).tolist() == [[1.5, -2.0, 2.0, 0.5, 1.0]]
    both = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = _row(both, prompt=[4], output=[0, 0, 3])
    assert process_logits(raw, [row]).tolist() == [[2.0, -1.0, 2.0, -0.25, 1.0]]
    # the state follows the output as it grows (one update per step)
    assert isinstance(row.sampler_state, PenaltyState)
    row.output_token_ids.append(2)
    assert process_logits(raw, [row]).tolist() == [[2.0, -1.0, 1.25, -0.25, 1.0]]


def test_pending_tokens_count_like_recorded_ones():
    """A token still on the device (``pending``, async scheduling) counts in the penalties and
    ``min_tokens`` as it will once recorded, in the row it belongs to (penalized rows after
    one that is not)."""
    raw = torch.tensor([[3.0, -1.0, 2.0, 0.5, 1.0]] * 3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(min_tokens=2, stop_token_ids=[4]),
    ]
    pending = torch.tensor([2, 3, 0])
    outputs = ([], [3], [1])
    now = [_row(p, output=out) for p, out in zip(params, outputs, strict=True)]
    later = [
        _row(p, output=[*out, t])
        for p, out, t in zip(params, outputs, pending.tolist(), strict=True)
    ]
    got = process_logits(raw, now, pending=pending)
    assert got.tolist() == process_logits(raw, later).tolist()
    # min_tokens 2: one recorded token and the pending one unmask the stop token
    assert got[2, 4] == raw[2, 4] and process_logits(raw, now)[2, 4] == float("-inf")


def test_greedy_rows_without_options_are_the_argmax_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(4, 97, generator=g)
    rows = [
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0, repetition_penalty=1.5), output=[5, 6]),
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0, min_tokens=3), output=[1]),
    ]
    x = process_logits(raw, rows, eos_token_ids={int(raw[3].argmax())})
    assert torch.equal(x[0], raw[0]) and torch.equal(x[2], raw[2])
    tokens = sample_rows(raw, rows, {int(raw[3].argmax())}).tokens
    assert tokens[0] == int(raw[0].argmax()) and tokens[2] == int(raw[2].argmax())
    assert tokens[3] != int(raw[3].argmax())  # EOS masked before min_tokens
    assert process_logits(raw[:1], rows[:1]) is raw[:1] or torch.equal(
        process_logits(raw[:1], rows[:1]), raw[:1]
    )


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    raw = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # EOS (1) first, a stop id (2) next
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample_rows(raw, [_row(p, output=[0])], {1}).tokens == [3]
    assert sample_rows(raw, [_row(p, output=[0, 0])], {1}).tokens == [1]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[2])
    assert sample_rows(raw, [_row(ignore, output=[0])], {1}).tokens == [1]  # EOS does not stop


def test_logprobs_are_the_raw_distributions():
    raw = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    rows = [
        _row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=4.0), output=[0]),
        _row(SamplingParams(temperature=0, logprobs=0)),
    ]
    out = sample_rows(raw, rows)
    want = torch.log_softmax(raw, dim=-1)
    assert out.tokens == [1, 2]  # the penalty moved row 0 off token 0
    assert out.logprobs[0] == pytest.approx({1: want[0, 1].item(), 0: want[0, 0].item()})
    assert next(iter(out.logprobs[0])) == 1  # the sampled token first, then the top ones
    assert out.logprobs[1] == pytest.approx({2: want[1, 2].item()})


def test_logprob_ties_do_not_depend_on_the_batch():
    """Equal logprobs at a row's cut go to the lowest ids, whatever the other rows ask for
    (async scheduling runs a stopped request's extra row beside the others)."""
    raw = torch.zeros(2, 1000)
    raw[:, ::7] = 5.0  # 143 tied maxima
    tokens = torch.tensor([0, 0])
    a, b = SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, logprobs=5)
    alone = logprob_rows(raw[:1], [a], tokens[:1]).dicts([a], [0])[0]
    beside = logprob_rows(raw, [a, b], tokens).dicts([a, b], [0, 0])
    assert alone == beside[0] == {0: pytest.approx(float(torch.log_softmax(raw[0], 0)[0]))}
    assert list(beside[1]) == [0, 7, 14, 21, 28]  # the sampled token, then the lowest ids


def test_top_logprobs_equal_a_stable_sort():
    """`_top_logprobs` (linear in the vocabulary) picks what a stable descending sort picks,
    ties in ascending ids, for every k and row on its own."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        vocab = int(torch.randint(5, 200, (1,), generator=g))
        x = torch.randint(-4, 4, (3, vocab), generator=g).float() * 0.37  # many ties
        if trial % 2:
            x = torch.log_softmax(torch.randn(3, vocab, generator=g), dim=-1)
        k = int(torch.randint(1, min(vocab, 20) + 1, (1,), generator=g))
        values, ids = _top_logprobs(x, k)
        want_v, want_i = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(values, want_v[:, :k]) and torch.equal(ids, want_i[:, :k])
        assert torch.equal(_top_logprobs(x[2:], k)[1], ids[2:])


# --- vLLM's shape on a tiny DSA checkpoint -----------------------------------------------------


def test_outputs_have_vllms_shape(llm):
    outs = llm.generate(
        ["t10 t11 t12", {"prompt": "t10 t11 t12"}, {"prompt_token_ids": [10, 11, 12]}], GREEDY
    )
    assert hisparse.RequestOutput is RequestOutput and hisparse.CompletionOutput is CompletionOutput
    assert [o.prompt for o in outs] == ["t10 t11 t12", "t10 t11 t12", None]
    assert len({o.request_id for o in outs}) == 3
    for o in outs:
        assert isinstance(o, RequestOutput) and o.finished and o.ok
        assert o.prompt_token_ids == [10, 11, 12]
        (c,) = o.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert len(c.token_ids) == 8 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == " ".join(f"t{t}" for t in c.token_ids) and c.logprobs is None
        # the conveniences read the first completion
        assert (o.text, o.token_ids, o.finish_reason) == (c.text, c.token_ids, c.finish_reason)
        assert o.metrics is c.metrics and o.metrics.first_token is not None
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_a_flat_token_list_is_one_prompt(llm):
    (one,) = llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=GREEDY)
    (nested,) = llm.generate(prompt_token_ids=[[10, 11, 12]], sampling_params=GREEDY)
    assert one.prompt_token_ids == [10, 11, 12] and one.token_ids == nested.token_ids
    two = llm.generate(prompt_token_ids=torch.tensor([[10, 11, 12], [13, 14, 15]]))
    assert [o.prompt_token_ids for o in two] == [[10, 11, 12], [13, 14, 15]]


def test_n_seeded_completions_are_reproducible_and_independent(llm):
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[prompts((20,))[0], [10, 11]], sampling_params=params)
    b = llm.generate(prompt_token_ids=[prompts((20,))[0], [10, 11]], sampling_params=params)
    for x, y in zip(a, b, strict=True):
        assert [c.index for c in x.outputs] == [0, 1, 2]
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert len({tuple(c.token_ids) for c in x.outputs}) > 1  # not the same draws
        assert all(c.metrics is not x.outputs[0].metrics for c in x.outputs[1:])
    other = SamplingParams(temperature=1.0, n=3, seed=6, max_tokens=8, ignore_eos=True)
    c = llm.generate(prompt_token_ids=[prompts((20,))[0]], sampling_params=other)
    assert [o.token_ids for o in c[0].outputs] != [o.token_ids for o in a[0].outputs]


def test_greedy_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(prompt_token_ids=[prompts((30,))[0]], sampling_params=params)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
        assert max(lp, key=lp.get) == tok  # greedy: the sampled token is the top one
    picked = [lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
    assert c.cumulative_logprob == pytest.approx(sum(picked))
    # asking for logprobs changes no token
    (plain,) = llm.generate(prompt_token_ids=[prompts((30,))[0]], sampling_params=GREEDY)
    assert plain.token_ids[:6] == c.token_ids


def test_min_tokens_masks_stop_token_ids(llm):
    prompt = [prompts((25,), seed=4)[0]]
    base = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0].token_ids
    stop = base[1]
    early = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])
    (cut,) = llm.generate(prompt_token_ids=prompt, sampling_params=early)
    assert cut.token_ids == base[:2] and cut.finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop
    late = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop], min_tokens=5)
    (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=late)
    assert len(out.token_ids) >= 5 and stop not in out.token_ids[:4]


def test_penalties_change_greedy_output(llm):
    prompt = [prompts((25,), seed=4)[0]]
    long = dict(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(**long))
    assert len(set(base[0].token_ids)) < 16  # the random model repeats itself
    for option in (
        dict(repetition_penalty=2.0),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=2.0),
    ):
        (out,) = llm.generate(
            prompt_token_ids=prompt, sampling_params=SamplingParams(**long, **option)
        )
        assert out.token_ids != base[0].token_ids, option
        assert len(set(out.token_ids)) > len(set(base[0].token_ids)), option


def test_stop_strings_cut_the_text(llm):
    (base,) = llm.generate("t10 t11 t12", GREEDY)
    words = base.text.split()
    second = words[1]
    (out,) = llm.generate("t10 t11 t12", SamplingParams(temperature=0, max_tokens=8, stop=second))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == second
    assert second not in out.text and out.text == base.text[: base.text.index(second)]


def test_chat_uses_the_checkpoints_template(llm, checkpoint):
    conv = [{"role": "system", "content": "t20"}, {"role": "user", "content": "t10 t11"}]
    (out,) = llm.chat(conv, GREEDY)
    assert out.prompt == "t0 t2 t6 t20 t3 t2 t4 t10 t11 t3 t2 t5 "
    assert out.prompt_token_ids == [0, 2, 6, 20, 3, 2, 4, 10, 11, 3, 2, 5]
    (same,) = llm.generate(prompt_token_ids=out.prompt_token_ids, sampling_params=GREEDY)
    assert same.token_ids == out.token_ids
    two = llm.chat([conv, [{"role": "user", "content": "t12"}]], GREEDY)
    assert len(two) == 2 and two[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match="template refused them: unknown role tool"):
        llm.chat([{"role": "tool", "content": "t1"}])


@pytest.mark.parametrize(
    ("messages", "error", "needle"),
    [
        ("hello", TypeError, "messages='hello' must be a list of"),
        ([], ValueError, "non-empty conversation"),
        ([{"role": "user"}], ValueError, r"messages\[0\]=.* must be a dict with a 'content' key"),
        ([{"content": "x"}], ValueError, "'role' key"),
        ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\['content'\]=5 must be"),
        ([{"role": "", "content": "x"}], ValueError, "must be one of 'system', 'user'"),
        (
            [{"role": "wizard", "content": "x"}],
            ValueError,
            r"messages\[0\]\['role'\]='wizard' must be one of .*'developer', e.g. ",
        ),
        ([[{"role": "user", "content": "x"}], "no"], TypeError, r"messages\[1\]='no'"),
        ([["user", "x"]], TypeError, r"messages\[0\]\[0\]='user' must be a dict"),
    ],
)
def test_bad_chat_messages_are_clear_errors(llm, messages, error, needle):
    with pytest.raises(error, match=needle):
        llm.chat(messages)


def test_chat_without_a_template_says_so(tmp_path, checkpoint, tiny_checkpoint):
    """A DeepSeek-V3.2 checkpoint without a template chats through the built-in encoder (its
    release ships none); another model without one says so."""
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "tokenizer_config.json").unlink()
    with tiny_llm(bare) as llm:
        out = llm.chat([{"role": "user", "content": "t10"}], SamplingParams(max_tokens=1))
        assert out[0].prompt == "<｜begin▁of▁sentence｜><｜User｜>t10<｜Assistant｜></think>"
    glm = tmp_path / "glm"
    shutil.copytree(tiny_checkpoint("glm_moe_dsa"), glm)
    add_tokenizer(glm)
    (glm / "tokenizer_config.json").unlink()
    with tiny_llm(glm) as llm, pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "t10"}])


# --- defaults that work for any checkpoint -----------------------------------------------------


def test_kv_format_auto_and_each_documented_format_run_or_are_refused(checkpoint, tiny_checkpoint):
    """The make-tiny default (kv_lora_rank 128, rope 16) has 164-byte fp8 rows: auto picks
    fp32 rows for the fp32 CPU model, bf16 and fp32 run, fp8_ds_mla is refused at once with
    the format to use. A checkpoint whose fp8 rows are aligned gets fp8_ds_mla from auto."""
    tokens = {}
    for fmt in ("auto", "bf16", "fp32"):
        with tiny_llm(checkpoint, kv_format=fmt) as llm:
            tokens[fmt] = llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=GREEDY)
            assert tokens[fmt][0].ok
            assert llm.runner.row_format == ("fp32" if fmt == "auto" else fmt)
    assert tokens["auto"][0].token_ids == tokens["fp32"][0].token_ids
    with pytest.raises(ValueError, match=r"kv_format='fp8_ds_mla' gives rows of 164 bytes.*use "):
        tiny_llm(checkpoint, kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_format='fp16' must be one of"):
        tiny_llm(checkpoint, kv_format="fp16")
    aligned = tiny_checkpoint(
        "deepseek_v32", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2
    )
    with tiny_llm(aligned) as llm:  # fp8 rows of 656 bytes
        assert llm.runner.row_format == "fp8_ds_mla"
        assert llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=GREEDY)[0].ok


def test_dtype_takes_strings_and_torch_dtypes(checkpoint):
    for dtype, want in (
        (torch.float32, torch.float32),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("bf16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ):
        with tiny_llm(checkpoint, dtype=dtype) as llm:
            assert llm.model.model.embed_tokens.weight.dtype == want, dtype
    with pytest.raises(ValueError, match=r"LLM.dtype='int8' must be 'auto', 'float32'"):
        tiny_llm(checkpoint, dtype="int8")
    with pytest.raises(ValueError, match=r"LLM.dtype=torch.int8"):
        tiny_llm(checkpoint, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"LLM.dtype=32"):
        tiny_llm(checkpoint, dtype=32)


def test_max_model_len_above_the_models_limit_is_refused(checkpoint):
    with pytest.raises(ValueError, match=r"max_model_len=5000 must be at most .* of 4096 tokens"):
        tiny_llm(checkpoint, max_model_len=5000)
    with tiny_llm(checkpoint, max_model_len=4096, hisparse=HiSparseConfig(block_size=16)) as llm:
        assert llm.max_model_len == 4096


def test_ctrl_c_in_generate_prints_the_partial_answer(checkpoint, capsys, monkeypatch):
    """Ctrl-C during the 4th step: the answer so far, "interrupted", exit status 130; the
    API raises `GenerationInterrupted` (a KeyboardInterrupt) carrying the outputs."""
    from hisparse.cli import main
    from hisparse.engine.model_runner import ModelRunner

    run_part = ModelRunner.execute_part
    calls = []

    def interrupted(self, step):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return run_part(self, step)

    monkeypatch.setattr(ModelRunner, "execute_part", interrupted)
    argv = ["generate", "--model", str(checkpoint), "--prompt", "t10 t11", "--max-tokens", "8",
            "--max-model-len", "128", "--gpu-memory-gib", "0.02"]  # fmt: skip
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err
    answer = captured.out.split("Answer (so far):", 1)[1].split()
    assert len(answer) == 3 and all(w.startswith("t") for w in answer)  # 3 tokens made it

    calls.clear()
    with tiny_llm(checkpoint) as llm:
        with pytest.raises(hisparse.GenerationInterrupted) as exc:
            llm.generate(prompt_token_ids=[[10, 11], [12, 13]], sampling_params=GREEDY)
        outs = exc.value.outputs
        assert isinstance(exc.value, KeyboardInterrupt) and len(outs) == 2
        assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < 8 for o in outs)
        assert not llm.scheduler.running and not llm.kv.requests  # usable again
        monkeypatch.setattr(ModelRunner, "execute_part", run_part)
        assert llm.generate(prompt_token_ids=[10, 11], sampling_params=GREEDY)[0].ok


# --- SmolLM2 ---------------------------------------------------------------------------------

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _need_smollm2() -> None:
    from hisparse.models.smollm2 import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
        pytest.skip(str(err))


def test_smollm2_kv_formats():
    """bf16 rows used to crash the first decode step on the CPU (the batch-1 fast path wrote
    fp32 rows into them); fp8_ds_mla (an MLA format) is refused before the model loads."""
    _need_smollm2()
    with pytest.raises(ValueError, match="kv_format='fp8_ds_mla' must be one of 'auto', 'bf16'"):
        LLM("smollm2", kv_format="fp8_ds_mla")
    with LLM("smollm2", kv_format="bf16", max_model_len=256, max_num_seqs=1,
             gpu_memory_gib=0.05) as llm:  # fmt: skip
        (out,) = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=6))
    assert out.ok and len(out.token_ids) == 6 and "Paris" in out.text


@pytest.fixture(scope="module")
def smol():
    _need_smollm2()
    with LLM("smollm2", max_model_len=512, max_num_seqs=4, gpu_memory_gib=0.1) as llm:
        yield llm


def test_smollm2_chat_outputs_and_logprobs(smol):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    (out,) = smol.chat(FRANCE, params)
    c = out.outputs[0]
    assert "Paris" in c.text and out.prompt.startswith("<|im_start|>")
    assert out.prompt_token_ids == smol.tokenizer.encode_chat(FRANCE)
    assert len(c.logprobs) == len(c.token_ids)
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp[tok] <= 0 and max(lp, key=lp.get) == tok
    assert math.isfinite(c.cumulative_logprob) and c.cumulative_logprob <= 0


def test_smollm2_min_tokens_keeps_eos_out(smol):
    short = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    (base,) = smol.chat(short, SamplingParams(temperature=0, max_tokens=24))
    eos = smol.tokenizer.eos_token_id
    assert base.finish_reason == "stop" and base.token_ids[-1] == eos
    n = len(base.token_ids) + 4
    (out,) = smol.chat(short, SamplingParams(temperature=0, max_tokens=24, min_tokens=n))
    assert len(out.token_ids) >= n and eos not in out.token_ids[: n - 1]


def test_smollm2_repetition_penalty_and_seeded_n(smol):
    text = "1, 1, 1, 1, 1, 1, 1, 1, 1, 1,"
    (base,) = smol.generate(text, SamplingParams(temperature=0, max_tokens=8))
    penalized = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.5)
    (pen,) = smol.generate(text, penalized)
    assert base.text.count("1") > pen.text.count("1") and pen.token_ids != base.token_ids
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=6)
    a, b = (smol.chat(FRANCE, params)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
