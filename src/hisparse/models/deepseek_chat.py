"""DeepSeek-V3.2's conversation format, written from the release's documentation of its prompt
encoder (the release ships no Jinja chat template: its prompts come from a Python encoder).

The format, turn by turn:

- the prompt starts with ``<｜begin▁of▁sentence｜>``; a system turn is its text, followed by
  the tools' block (``## Tools`` with the DSML calling convention and each tool's JSON
  schema inside ``<functions>``) when the request has tools;
- a user turn is ``<｜User｜>{text}<｜Assistant｜>`` followed by ``<think>`` when it is the
  last user turn in thinking mode, else by ``</think>`` (a developer turn likewise, its text
  after the tools as ``# The user's message is: ...``);
- an assistant turn is its text, then its calls as ``\\n\\n<｜DSML｜function_calls>`` with
  one ``<｜DSML｜invoke name="f">`` per call and one ``<｜DSML｜parameter name="p"
  string="true|false">`` per argument (strings as is, anything else as JSON), then
  ``<｜end▁of▁sentence｜>``; in
  thinking mode an assistant turn after the last user turn first carries its reasoning and
  ``</think>``, and the reasoning of turns before the last user turn is dropped;
- tool turns answering one assistant turn's calls are one ``<function_results>`` block with a
  ``<result>`` per call, then ``<think>`` (thinking mode, after the last user turn) or
  ``</think>``.

Thinking mode is ``chat_template_kwargs={"thinking": true}`` (vLLM's switch for DeepSeek);
chat mode is the default. Request-level ``tools`` join the first system turn (a system turn
with no text is added when there is none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
#: the tokenizer's special tokens of this format (`make-tiny` adds them to its tokenizer)
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)

_TOOLS_HEADER = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK}...thinking about results{END_THINK}
Here are the functions available in JSONSchema format:
<functions>
"""  # noqa: E501 (the format's own lines)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system turn's tools section: the calling convention and each tool's schema (the
    ``function`` object of OpenAI's tool, as JSON, one per line)."""
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return f"{_TOOLS_HEADER}{schemas}\n</functions>\n"


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return json.loads(args) if isinstance(args, str) else dict(args)


def calls_block(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's tool calls in DSML (what `serve.tools.parse_deepseek_dsml` reads)."""
    invokes = []
    for call in calls:
        params = [
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for k, v in _arguments(call).items()
        ]
        name = call.get("function", call)["name"]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


class DeepSeekV32Encoder:
    """DeepSeek-V3.2's prompts with the `ChatTemplate` interface (``render``), so `LLM.chat`
    and the server use it where a Jinja template would be."""

    source = "deepseek_v32 (built in: the release's documented encoding)"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        **_: Any,
    ) -> str:
        msgs = [dict(m) for m in messages]
        if tools:
            if msgs and msgs[0].get("role") == "system":
                msgs[0]["tools"] = list(tools)
            else:
                msgs.insert(0, {"role": "system", "content": "", "tools": list(tools)})
        users = [i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")]
        last_user = users[-1] if users else -1
        out = [BOS]
        for i, m in enumerate(msgs):
            out.append(self._turn(i, m, msgs, last_user, thinking))
        return "".join(out)

    def _turn(
        self, i: int, m: dict[str, Any], msgs: list[dict[str, Any]], last_user: int, think: bool
    ) -> str:
        role, text = m.get("role"), m.get("content") or ""
        opens = THINK if think and i == last_user else END_THINK
        if role == "system":
            return text + ("\n\n" + tools_block(m["tools"]) if m.get("tools") else "")
        if role == "user":
            return f"{USER}{text}{ASSISTANT}{opens}"
        if role == "developer":
            if not text:
                raise ValueError(f"messages[{i}]: a developer message needs content")
            tools = "\n\n" + tools_block(m["tools"]) if m.get("tools") else ""
            return f"{USER}{tools}\n\n# The user's message is: {text}{ASSISTANT}{opens}"
        if role == "assistant":
            reasoning = ""
            if think and i > last_user:
                reasoning = (m.get("reasoning_content") or m.get("reasoning") or "") + END_THINK
            calls = calls_block(m["tool_calls"]) if m.get("tool_calls") else ""
            return f"{reasoning}{text}{calls}{EOS}"
        if role == "tool":
            return self._result(i, text, msgs, last_user, think)
        raise ValueError(f"messages[{i}]: role {role!r} is not one of DeepSeek-V3.2's")

    def _result(
        self, i: int, text: str, msgs: list[dict[str, Any]], last_user: int, think: bool
    ) -> str:
        j = i - 1
        while j >= 0 and msgs[j].get("role") == "tool":
            j -= 1
        calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else []
        order = i - j
        if not calls or len(calls) < order:
            raise ValueError(f"messages[{i}]: a tool result without an assistant call to answer")
        out = ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{text}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + (THINK if think and i >= last_user else END_THINK)
        return out
