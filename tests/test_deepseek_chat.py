"""DeepSeek-V3.2's conversations (issue #54): the built-in encoder gives the release's
documented prompt format (system prompt, tools, thinking on and off, multi-turn history with
tool calls and results), a tiny DeepSeek-V3.2 checkpoint from `make_tiny` chats through it
(`LLM.chat`, the server's tools), and its DSML calls round-trip through the parser."""

from __future__ import annotations

import json

import pytest

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.models.deepseek_chat import DeepSeekV32Encoder, calls_block, tools_block
from hisparse.serve.tools import parse_deepseek_dsml

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
ARGS = '{"city": "Paris", "days": 2}'
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
enc = DeepSeekV32Encoder()


def test_chat_mode_system_and_history():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "dropped"},
        {"role": "user", "content": "1+1?"},
    ]
    want = f"{B}Be brief.{U}hi{A}</think>Hello!{E}{U}1+1?{A}</think>"
    assert enc.render(msgs) == want


def test_thinking_mode_opens_a_thought_and_keeps_only_the_last_turns_reasoning():
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "1+1?"},
    ]
    want = f"{B}{U}hi{A}</think>Hello!{E}{U}1+1?{A}<think>"
    assert enc.render(msgs, thinking=True) == want
    # an assistant turn after the last user turn carries its reasoning, then </think>
    more = [*msgs, {"role": "assistant", "content": "2", "reasoning_content": "add"}]
    assert enc.render(more, thinking=True) == want + f"add</think>2{E}"


def test_tools_calls_and_results():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    schema = json.dumps(TOOL["function"], ensure_ascii=False)
    system = f"S\n\n{tools_block([TOOL])}"
    assert system.endswith(f"<functions>\n{schema}\n</functions>\n")
    assert system.startswith("S\n\n## Tools\nYou have access to a set of tools")
    invoke = (f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
              f'</{D}parameter>\n<{D}parameter name="days" string="false">2</{D}parameter>\n'
              f"</{D}invoke>")  # fmt: skip
    calls = f"\n\n<{D}function_calls>\n{invoke}\n{invoke}\n</{D}function_calls>"
    assert calls_block([CALL, CALL]) == calls
    results = "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>"
    want = (f"{B}{system}{U}weather?{A}</think>{calls}{E}{results}\n</function_results>\n\n"
            "</think>")  # fmt: skip
    assert enc.render(msgs, tools=[TOOL]) == want
    # thinking on: the results open a thought; tools without a system turn get one of their own
    assert enc.render(msgs, tools=[TOOL], thinking=True).endswith("</function_results>\n\n<think>")
    assert enc.render(msgs[1:2], tools=[TOOL]).startswith(f"{B}\n\n## Tools\n")
    # DSML the encoder writes is what the parser reads
    content, parsed = parse_deepseek_dsml("Checking." + calls)
    assert content == "Checking." and [json.loads(c.arguments) for c in parsed] == [
        {"city": "Paris", "days": 2}] * 2  # fmt: skip
    with pytest.raises(ValueError, match="tool result without"):
        enc.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_a_tiny_checkpoint_chats_through_the_encoder(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v32", tokenizer=True)
    with LLM(path, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4), max_model_len=1024,
             max_num_seqs=2, gpu_memory_gib=0.02, device="cpu") as llm:  # fmt: skip
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
        out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3))
        assert out[0].prompt == enc.render(msgs)
        ids = llm.chat_token_ids(msgs, tools=[TOOL], thinking=True)
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == enc.render(
            msgs, tools=[TOOL], thinking=True)  # fmt: skip
        special = {llm.tokenizer.token_to_id(t) for t in (B, U, A, "<think>")}
        assert special <= set(ids)  # the format's markers are single tokens
