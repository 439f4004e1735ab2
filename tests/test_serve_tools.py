"""What agents send, through the official `openai` client against a real `hisparse serve` with
the bundled SmolLM2 (issue #54): JSON output (`response_format` json_object and a json_schema
with nested objects, arrays and enums) that parses and validates, tool calls (a named function,
``required``) whose arguments validate against the tool's schema, streamed and not, ``tool``
role messages in the conversation; and the tool-call parsers of each family on their formats."""

from __future__ import annotations

import json

import pytest

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.serve.tools import parse_deepseek_dsml, parse_glm, parse_hermes

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

from hisparse.serve.background import serve_in_thread  # noqa: E402 (needs uvicorn)

TIMEOUT = 180.0
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    llm = LLM("smollm2", hisparse=HiSparseConfig(host_pool_gib=0.25), max_model_len=512,
              max_num_seqs=4, gpu_memory_gib=0.25, device="cpu")  # fmt: skip
    with serve_in_thread(llm, model_name="smollm2") as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", timeout=TIMEOUT,
                            max_retries=0)  # fmt: skip
    llm.close()


def test_json_object_and_schema_parse_and_validate(client):
    msgs = [{"role": "user", "content": "Describe Ada, a 36 year old engineer from London."}]
    out = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=80, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), PERSON)
    yes_no = [{"role": "user", "content": 'Is Paris in France? Answer in JSON, key "answer".'}]
    out = client.chat.completions.create(
        model="smollm2", messages=yes_no, max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c


def test_named_and_required_tool_calls_validate(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
        tool_choice=named,
    )  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the same call, its arguments in pieces
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
        tool_choice=named, stream=True,
    ))  # fmt: skip
    parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
        tool_choice="required",
    )  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_turns_and_bad_choices(client):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]  # fmt: skip
    out = client.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                         temperature=0, tools=[WEATHER])  # fmt: skip
    assert out.choices[0].message.role == "assistant"
    # tool_choice "auto" (the default with tools), streamed: the same text as it comes
    kw = dict(model="smollm2", messages=history, max_tokens=4, temperature=0, tools=[WEATHER])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=4, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                       tool_choice="required")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="not with tool_choice"):
        client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=4, tools=[WEATHER],
            tool_choice="required", response_format={"type": "json_object"},
        )  # fmt: skip


def test_parsers_read_each_family_format():
    content, calls = parse_hermes(
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}), ("g", {})]  # fmt: skip
    assert parse_hermes("no calls <tool_call>not json</tool_call>")[1] == []
    d = "｜DSML｜"
    text = (f'Let me check.\n\n<{d}function_calls>\n<{d}invoke name="get_weather">\n'
            f'<{d}parameter name="city" string="true">Paris</{d}parameter>\n'
            f'<{d}parameter name="days" string="false">3</{d}parameter>\n'
            f'</{d}invoke>\n</{d}function_calls>')  # fmt: skip
    content, calls = parse_deepseek_dsml(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]  # fmt: skip
    content, calls = parse_glm(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]  # fmt: skip


def test_auto_streams_text_until_the_call_markup():
    from hisparse.serve.tools import ToolReader

    pieces = ["Sure", " <", "tool_call>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>"]

    def raw(ids):
        return "".join(pieces[i] for i in ids)

    reader = ToolReader("auto", None, "hermes", raw)
    got = [reader.delta(0, "", [i], None)[0] for i in range(len(pieces) - 1)]
    assert got == [{"content": "Sure"}, {"content": " "}, None, None]  # "<" waits, then stops
    delta, why = reader.delta(0, "", [len(pieces) - 1], "stop")
    assert why == "tool_calls" and delta["tool_calls"][0]["index"] == 0
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    plain = ToolReader("auto", None, "hermes", raw)
    assert plain.delta(1, "", [0], None)[0] == {"content": "Sure"}
    assert plain.delta(1, "", [1], "stop") == ({"content": " <"}, "stop")  # no call: all text
