"""GLM-5's conversation format (the GLM-4.5+ family's, as GLM-5 ships it in its chat template),
as a Jinja chat template that `make-tiny` writes beside a tiny ``glm_moe_dsa`` checkpoint, so
that `LLM.chat` and the server render the family's prompts, thinking switch and tool calls.
A real GLM-5 checkpoint brings its own template; this one renders the same text for what
hisparse sends (written from the format, checked by hand-built strings in the tests).

The format (no newlines between the parts unless written here):

- the prompt starts with ``[gMASK]<sop>``; with tools, a ``<|system|>`` turn lists them: a
  ``# Tools`` preamble, each tool's JSON (as the request gives it, ``{"type": "function",
  "function": {...}}``) on its own line inside ``<tools>``, and the calling convention;
- a system (or developer) turn is ``<|system|>{text}``, a user turn ``<|user|>{text}``;
- an assistant turn is ``<|assistant|>``, then ``<think>{reasoning}</think>`` when it has
  reasoning and comes after the last user turn (every turn's with
  ``clear_thinking=False``), else a bare ``</think>``; then its text, then each call as
  ``<tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value>...</tool_call>``
  (string values as is, others as JSON);
- consecutive tool turns are one ``<|observation|>`` followed by a
  ``<tool_response>{text}</tool_response>`` per result;
- the generation prompt is ``<|assistant|><think>`` (thinking, the default) or
  ``<|assistant|></think>`` with ``chat_template_kwargs={"enable_thinking": false}``.

The model ends a turn with ``<|endoftext|>``, ``<|user|>`` or ``<|observation|>``.
"""

from __future__ import annotations

#: the tokenizer's special tokens of this format (`make-tiny` adds them to its tokenizer)
SPECIAL_TOKENS = (
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
    "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)  # fmt: skip

TOOLS_HEADER = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
    "<arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
    "{arg-value-2}</arg_value>...</tool_call>"
)

#: the chat template (rendered by `hisparse.models.tokenizer.ChatTemplate`, as transformers
#: renders one: trim_blocks, lstrip_blocks)
TEMPLATE = (
    """{%- macro text_of(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}{{- part.text -}}
{%- elif part is string -%}{{- part -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>' + """
    + repr(TOOLS_HEADER)
    + """ -}}
{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}
{{- """
    + repr(TOOLS_FOOTER)
    + """ -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- set keep_all = clear_thinking is defined and not clear_thinking -%}
{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'developer' -%}
{{- '<|system|>' + text_of(m.content) -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>' + text_of(m.content) -}}
{%- elif m.role == 'assistant' -%}
{%- set content = text_of(m.content) | string -%}
{%- set reasoning = '' -%}
{%- if m.reasoning_content is string -%}
{%- set reasoning = m.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{{- '<|assistant|>' -}}
{%- if reasoning.strip() and (loop.index0 > ns.last_user or keep_all) -%}
{{- '<think>' + reasoning.strip() + '</think>' -}}
{%- else -%}
{{- '</think>' -}}
{%- endif -%}
{{- content.strip() -}}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '<tool_call>' + fn.name -}}
{%- if fn.arguments is mapping -%}
{%- for k, v in fn.arguments.items() -%}
{{- '<arg_key>' + k + '</arg_key><arg_value>' -}}
{{- v if v is string else v | tojson(ensure_ascii=False) -}}
{{- '</arg_value>' -}}
{%- endfor -%}
{%- elif fn.arguments -%}
{{- raise_exception('tool call arguments must be a JSON object') -}}
{%- endif -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}
{%- endif -%}
{{- '<tool_response>' + text_of(m.content) + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' -}}
{{- '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' -}}
{%- endif -%}
"""
)
