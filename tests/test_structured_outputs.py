"""Structured outputs (issue #54): xgrammar's token masks inside the sampler, the grammar rows
beside free ones (which must not change), and a real `hisparse serve` over a tiny DSA
checkpoint (random weights, a byte-level tokenizer) driven by the official `openai` client:
JSON schemas with nested objects, arrays and enums validate, choices and regexes hold, bad
specs are a 400 naming the field, and a list of prompts equals the prompts sent alone."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.grammar import unpack_bitmask
from hisparse.engine.llm import LLM
from hisparse.engine.structured_params import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from hisparse.serve.background import serve_in_thread  # noqa: E402 (needs uvicorn)

TIMEOUT = 120.0
#: nested objects, an array and enums; short strings and compact JSON so that a random
#: model's answer closes well before max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 3},
        "kind": {"enum": ["cat", "dog"]},
        "pos": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["ok", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "pos"],
    "additionalProperties": False,
}


def test_unpack_bitmask_matches_xgrammar_on_random_bits():
    g = torch.Generator().manual_seed(0)
    V = 1000
    bits = torch.randint(-(2**31), 2**31 - 1, (5, (V + 31) // 32), generator=g, dtype=torch.int32)
    logits = torch.randn(5, V, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bits)
    got = torch.full_like(logits, float("nan"))  # poisoned: every entry is written below
    got.copy_(logits.masked_fill(~unpack_bitmask(bits, V), float("-inf")))
    assert torch.equal(got, want)


def test_grammar_masks_match_the_torch_reference(llm):
    """`apply_grammar_masks` (xgrammar's kernel, rows 1 and 3 of 4) against `unpack_bitmask`
    applied in torch, on fresh random logits; the other rows are not touched."""
    from hisparse.engine.grammar import apply_grammar_masks

    g = torch.Generator().manual_seed(1)
    V = llm.model.config.vocab_size
    logits = torch.randn(4, V, generator=g)
    specs = [StructuredOutputsParams(regex="[a-c]+x"), StructuredOutputsParams(choice=["yes"])]
    got = logits.clone()
    apply_grammar_masks(got, [1, 3], [llm.grammars.matcher(s) for s in specs])
    want = logits.clone()
    for row, spec in zip([1, 3], specs, strict=True):
        bits = xgr.allocate_token_bitmask(1, V)
        llm.grammars.matcher(spec).fill_next_token_bitmask(bits, 0)
        want[row] = want[row].masked_fill(~unpack_bitmask(bits, V)[0], float("-inf"))
    assert torch.equal(got, want)
    assert torch.isfinite(got[1]).sum() == 3  # a, b, c
    assert torch.equal(got[[0, 2]], logits[[0, 2]])


def test_params_name_what_is_wrong():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"StructuredOutputsParams.json=.*not JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(TypeError, match=r"StructuredOutputsParams\.choice"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(TypeError, match=r"SamplingParams\.structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match=r"SamplingParams\.ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json='{"a": 2, "b": 1}').key()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v32", tokenizer=True)
    engine = LLM(
        path,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
        max_model_len=2048,
        max_num_seqs=4,
        gpu_memory_gib=0.02,
        device="cpu",
    )
    yield engine
    engine.close()


def test_grammar_rows_leave_free_rows_alone(llm):
    """A batch with grammar rows (greedy and sampled) gives the free rows the tokens they
    get alone, and async scheduling steps aside for the grammar rows without changing them."""
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    spec = StructuredOutputsParams(regex="[a-c]{2,5}")
    ruled = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    drawn = SamplingParams(temperature=1, seed=3, max_tokens=8, structured_outputs=spec)
    alone = llm.generate(["abc", "hello"], free)
    mixed = llm.generate(["abc", "xyz", "hello", "q"], [free, ruled, free, drawn])
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids]
    for out in (mixed[1], mixed[3]):
        assert re.fullmatch("[a-c]{2,5}", out.text), out.text
        assert out.finish_reason == "stop"
    again = llm.generate(["xyz"], ruled)  # alone: the same tokens
    assert again[0].token_ids == mixed[1].token_ids


def test_a_grammar_after_a_token_leaves_what_comes_before_free(llm):
    """``after_token`` (a thinking answer's end of reasoning): the tokens up to it are the
    free answer's, the rest match the constraint. (Before the server fixture: its engine loop
    owns ``llm`` from then on.)"""
    free = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4,
                                                  ignore_eos=True))[0].token_ids  # fmt: skip
    k = 1 if free[1] != free[0] else 0  # the token opens the grammar at its first occurrence
    spec = StructuredOutputsParams(regex="[a-c]{2,5}", after_token=free[k])
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=16,
                                                 structured_outputs=spec))[0]  # fmt: skip
    assert out.token_ids[: k + 1] == free[: k + 1]
    rest = llm.tokenizer.decode(out.token_ids[k + 1 :], skip_special_tokens=True)
    assert re.fullmatch("[a-c]{2,5}", rest) and out.finish_reason == "stop", rest
    with pytest.raises(TypeError, match="after_token"):
        StructuredOutputsParams(regex="a", after_token="</think>")


@pytest.fixture(scope="module")
def server(llm):
    with serve_in_thread(llm, model_name="tiny") as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)


def test_json_schema_through_openai_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in (0, 1):
        out = client.completions.create(
            model="tiny", prompt="A pet:", max_tokens=400, temperature=1.0, seed=seed,
            extra_body={"response_format": fmt},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    # vLLM's field, compact (no free whitespace), streamed: the same rules
    chunks = client.completions.create(
        model="tiny", prompt="Another:", max_tokens=120, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "\n" not in text


def test_choice_and_regex(client):
    out = client.completions.create(
        model="tiny", prompt="Yes or no?", max_tokens=8, temperature=1.0, seed=0, n=2,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert {c.text for c in out.choices} <= {"yes", "no"}
    out = client.completions.create(
        model="tiny", prompt="Phone:", max_tokens=12, temperature=1.0, seed=0,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{2}"},
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", out.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "(a", "guided_json": {}}, "guided_regex", "not several"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not JSON"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ],
)
def test_bad_specs_are_a_400_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body


def test_a_list_of_prompts_equals_each_alone(client):
    prompts = ["The capital", "1, 2, 3,", "x"]
    kw = dict(model="tiny", max_tokens=5, temperature=0, n=2, logprobs=1)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    for k, one in enumerate(alone):
        for i in range(2):
            got, want = batch.choices[k * 2 + i], one.choices[i]
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            assert got.logprobs.tokens == want.logprobs.tokens
    assert batch.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in alone)
    assert batch.usage.completion_tokens == sum(o.usage.completion_tokens for o in alone)
    chunks = list(client.completions.create(prompt=prompts, stream=True, **kw))
    texts = [""] * 6
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in batch.choices]
    # each prompt is checked on its own, and named
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]"):
        client.completions.create(model="tiny", prompt=[[5, 6], [10**6]], max_tokens=2)


def test_bounded_strings_refuse_raw_control_characters(llm):
    """xgrammar's ``maxLength`` strings admit raw U+0000-U+001F, which JSON forbids: the
    compiled grammar is patched (`grammar.json_string_fix`) to refuse them."""
    spec = StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 3}},
            "required": ["a"],
        },
        disable_any_whitespace=True,
    )
    ok, bad = llm.grammars.matcher(spec), llm.grammars.matcher(spec)
    assert ok.accept_string('{"a": "xy"}') and ok.is_completed()
    assert not bad.accept_string('{"a": "\x10')


def test_tiny_deepseek_chat_tools_and_thinking(client, llm):
    """The tiny DeepSeek-V3.2 checkpoint chats through its built-in encoder: a named tool's
    arguments validate (compact JSON, short strings), and in thinking mode the answer before
    ``</think>`` is ``reasoning_content`` (a random model never closes it in 6 tokens)."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                         "n": {"type": "boolean"}},
        "required": ["kind", "n"], "additionalProperties": False}}}  # fmt: skip
    msgs = [{"role": "user", "content": "Pick one."}]
    out = client.chat.completions.create(
        model="tiny", messages=msgs, tools=[tool], max_tokens=120, temperature=1.0, seed=0,
        tool_choice={"type": "function", "function": {"name": "pick"}},
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    out = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    message = out.choices[0].message
    assert message.reasoning_content and not message.content
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    ))  # fmt: skip
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in chunks if c.choices)  # fmt: skip
    assert streamed == message.reasoning_content


def test_reasoning_is_split_at_the_end_of_thinking():
    from hisparse.serve.tools import ToolReader

    def raw(ids):
        return "".join(f"<{i}>" for i in ids)

    reader = ToolReader("none", None, "deepseek_v32", raw, think_end=9)
    msg, why = reader.message("ignored", [1, 2, 9, 3], "stop")
    assert (msg["reasoning_content"], msg["content"], why) == ("<1><2>", "<3>", "stop")
    deltas = [reader.delta(0, t, [i], None)[0] for t, i in (("a", 1), ("", 9), ("b", 3))]
    assert deltas == [{"reasoning_content": "a"}, {}, {"content": "b"}]


def test_a_named_call_streams_its_reasoning_first():
    from hisparse.serve.tools import ToolReader

    def raw(ids):
        return "".join(f"<{i}>" for i in ids)

    reader = ToolReader("named", "f", "glm", raw, think_end=9)
    msg, _ = reader.message("ignored", [1, 2, 9, 3], "stop")
    assert msg["reasoning_content"] == "<1><2>" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": "<3>"}
    deltas = [reader.delta(0, t, [i], None)[0] for t, i in (("a", 1), ("", 9), ("{}", 3))]
    assert deltas[0] == {"reasoning_content": "a"}
    assert deltas[2]["tool_calls"][0]["function"]["arguments"] == "{}"
