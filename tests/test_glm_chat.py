"""GLM-5's conversations (issue #54): the chat template `make_tiny` writes beside a tiny
``glm_moe_dsa`` checkpoint renders the family's documented format (system prompt, tools,
thinking on and off, multi-turn history with tool calls and results); `LLM.chat` and a real
server (through the `openai` client) render it, its markers are single tokens, its tool calls
round-trip through the GLM parser, and the server's answers carry ``reasoning_content`` while
thinking (GLM-5's default)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.models.tokenizer import load_chat_template
from hisparse.serve.background import serve_in_thread
from hisparse.serve.tools import parse_glm

G, S, U, A, OBS = "[gMASK]<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}}}}}  # fmt: skip
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}  # fmt: skip
#: the tools' system turn, as the format writes it
TOOLS_TURN = (
    f"{S}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
    "...</tool_call>"
)
CALL_TEXT = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"  # fmt: skip
TIMEOUT = 120


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("glm_moe_dsa", tokenizer=True)


@pytest.fixture(scope="module")
def template(path):
    return load_chat_template(path)


def test_system_user_and_the_thinking_switch(template):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(msgs) == f"{G}{S}Be brief.{U}hi{A}<think>"  # thinking: the default
    off = f"{G}{S}Be brief.{U}hi{A}</think>"
    assert template.render(msgs, enable_thinking=False) == off
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert template.render([{"role": "user", "content": parts}], enable_thinking=False) == (
        f"{G}{U}hi{A}</think>")  # fmt: skip


def test_history_keeps_only_the_current_turns_reasoning(template):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>add</think>2"},  # reasoning inline
    ]
    want = f"{G}{U}hi{A}</think>Hello!{U}1+1?{A}<think>add</think>2"
    assert template.render(msgs, add_generation_prompt=False) == want
    kept = f"{G}{U}hi{A}<think>old thoughts</think>Hello!{U}1+1?{A}<think>add</think>2"
    assert template.render(msgs, add_generation_prompt=False, clear_thinking=False) == kept


def test_tools_calls_and_results(template):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    want = (f"{G}{TOOLS_TURN}{S}S{U}weather?{A}</think>Checking.{CALL_TEXT}{CALL_TEXT}"
            f"{OBS}<tool_response>sunny</tool_response><tool_response>rain</tool_response>"
            f"{A}<think>")  # fmt: skip
    assert template.render(msgs, tools=[TOOL]) == want
    # what the template writes is what the GLM parser reads
    content, calls = parse_glm("Checking." + CALL_TEXT + CALL_TEXT)
    assert content == "Checking." and [json.loads(c.arguments) for c in calls] == [
        {"city": "Paris", "days": 2}] * 2  # fmt: skip


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(path, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
                 max_model_len=2048, max_num_seqs=4, gpu_memory_gib=0.02, device="cpu")  # fmt: skip
    yield engine
    engine.close()


def test_llm_chat_renders_the_template(llm, template):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2),
                   chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert out[0].prompt == f"{G}{U}hi{A}</think>"
    ids = llm.chat_token_ids(msgs, tools=[TOOL])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == template.render(
        msgs, tools=[TOOL])  # fmt: skip
    markers = ("[gMASK]", "<sop>", S, U, A, "<think>")
    assert {llm.tokenizer.token_to_id(t) for t in markers} <= set(ids)  # single tokens


@pytest.fixture(scope="module")
def client(llm):
    with serve_in_thread(llm, model_name="tiny") as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", timeout=TIMEOUT,
                            max_retries=0)  # fmt: skip


def test_server_thinks_by_default_and_streams_the_reasoning(client, llm):
    """Thinking (the template's default): the answer before ``</think>`` is
    ``reasoning_content`` (a random model rarely closes it in 6 tokens), streamed as such, and
    free under a response format; ``enable_thinking: false`` answers without it. The prompt
    is the documented one."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                         temperature=0)  # fmt: skip
    message = out.choices[0].message
    assert message.reasoning_content
    assert out.usage.prompt_tokens == len(llm.encode(f"{G}{S}S{U}hi{A}<think>",
                                                     add_special_tokens=False))  # fmt: skip
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == (message.content or "")
    # a response format holds from the end of the reasoning: the reasoning is the free one
    fmt = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert fmt.choices[0].message.reasoning_content == message.reasoning_content
    off = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True},
    )  # fmt: skip
    assert off.choices[0].message.content
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.prompt_tokens == out.usage.prompt_tokens  # </think> for <think>


def test_server_named_tool_over_a_multi_turn_history(client, llm):
    """A history with a call and its result, tools in the prompt, and a named tool choice:
    the arguments validate against the tool's schema. Thinking (the default), the schema
    holds from the end of the reasoning, which comes back as ``reasoning_content`` (a random
    model rarely ends it: then no call, ``finish_reason`` "length")."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                         "n": {"type": "boolean"}},
        "required": ["kind", "n"], "additionalProperties": False}}}  # fmt: skip
    call = {"id": "c1", "type": "function",
            "function": {"name": "pick", "arguments": '{"kind": "cat", "n": true}'}}  # fmt: skip
    msgs = [{"role": "user", "content": "Pick one."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "Again."}]  # fmt: skip
    named = {"type": "function", "function": {"name": "pick"}}
    out = client.chat.completions.create(
        model="tiny", messages=msgs, tools=[tool], max_tokens=120, temperature=1.0, seed=0,
        tool_choice=named, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    (got,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(got.function.arguments), tool["function"]["parameters"])
    history = (f"{U}Pick one.{A}</think><tool_call>pick<arg_key>kind</arg_key><arg_value>cat"
               f"</arg_value><arg_key>n</arg_key><arg_value>true</arg_value></tool_call>"
               f"{OBS}<tool_response>ok</tool_response>{U}Again.{A}</think>")  # fmt: skip
    thinking = client.chat.completions.create(
        model="tiny", messages=msgs, tools=[tool], max_tokens=8, temperature=0, tool_choice=named
    )
    message = thinking.choices[0].message
    assert message.reasoning_content and message.tool_calls is None
    assert thinking.choices[0].finish_reason == "length"
    # the server's conversation as chat templates read it: the call's arguments an object
    parsed = {**call, "function": {"name": "pick", "arguments": {"kind": "cat", "n": True}}}
    local = [{**msgs[1], "content": "", "tool_calls": [parsed]} if i == 1 else m
             for i, m in enumerate(msgs)]  # fmt: skip
    ids = llm.chat_token_ids(local, tools=[tool], enable_thinking=False)
    rendered = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.endswith(history)
    assert out.usage.prompt_tokens == len(llm.encode(rendered, add_special_tokens=False))
