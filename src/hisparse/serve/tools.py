"""Tool calling on ``/v1/chat/completions`` (docs/design.md §15.1): the tools go to the chat
template, ``tool_choice`` decides how the answer is read.

- ``none`` (or no tools): plain text.
- a named function: the output is constrained to a JSON object valid under that function's
  ``parameters`` schema (a structured output), and that object is the call's arguments.
- ``required``: constrained to a JSON array of one or more ``{"name", "parameters"}`` objects,
  each name one of the tools and its parameters valid under that tool's schema (vLLM's form).
- ``auto``: free text, parsed by the model family's tool-call parser (`parser_for`): the calls
  it finds become ``tool_calls``, the rest stays ``content``.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

#: a function without ``parameters`` takes any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    #: the arguments as JSON text (OpenAI's ``function.arguments``)
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict[str, Any]:
        fn = dict(name=self.name, arguments=self.arguments)
        out: dict[str, Any] = dict(id=self.id, type="function", function=fn)
        return out if index is None else {"index": index, **out}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The arguments' schema of the tool called ``name`` (a `ValueError` if none is)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return parameters(tool)
    names = ", ".join(repr(t["function"]["name"]) for t in tools) or "none"
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools ({names})")


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-empty JSON array of calls, each ``{"name": <a tool>, "parameters": <its args>}``."""
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` answer (JSON the grammar made: it parses)."""
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in json.loads(text)]  # fmt: skip


# --- ``auto``: a parser per model family ------------------------------------------------------


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen / ChatML-style calls: ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` blocks; the text before the first is the content. A block that is not such
    JSON stays in the content."""
    calls, spans = [], []
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(str(name), args_text))
        spans.append(m.span())
    if not calls:
        return text, []
    return _content(text[: spans[0][0]]), calls


def parse_deepseek_dsml(text: str) -> tuple[str | None, list[ToolCall]]:
    """DeepSeek-V3.2's DSML calls: a ``<｜DSML｜function_calls>`` block of ``<｜DSML｜invoke
    name="f">`` elements, each holding ``<｜DSML｜parameter name="p" string="true|false">v
    </｜DSML｜parameter>`` (``string="false"``: the value is JSON)."""
    start = text.find(f"<{DSML}function_calls>")
    if start < 0:
        return text, []
    calls = []
    invoke = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
    param = re.compile(
        rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S
    )
    for m in invoke.finditer(text, start):
        args: dict[str, Any] = {}
        for p in param.finditer(m.group(2)):
            value = p.group(3)
            if p.group(2) == "false":
                with contextlib.suppress(ValueError):
                    value = json.loads(value)
            args[p.group(1)] = value
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    return _content(text[:start]), calls


def parse_glm(text: str) -> tuple[str | None, list[ToolCall]]:
    """GLM-4.5 / GLM-5 calls: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>
    ...</tool_call>`` (a value that parses as JSON is taken as JSON, else as a string)."""
    calls, first = [], None
    for m in re.finditer(r"<tool_call>\s*([^<\s]+)\s*(.*?)</tool_call>", text, re.S):
        args: dict[str, Any] = {}
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", m.group(2),
                           re.S)  # fmt: skip
        for key, value in pairs:
            try:
                args[key.strip()] = json.loads(value)
            except ValueError:
                args[key.strip()] = value
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
        first = m.start() if first is None else first
    if not calls:
        return text, []
    return _content(text[:first]), calls


DSML = "｜DSML｜"
PARSERS = {"hermes": parse_hermes, "deepseek_v32": parse_deepseek_dsml, "glm": parse_glm}
#: where each family's calls start: an ``auto`` stream shows the text before it as it comes
MARKERS = {"hermes": "<tool_call>", "deepseek_v32": f"<{DSML}function_calls>", "glm": "<tool_call>"}


def parser_for(model: Any) -> str:
    """The tool-call parser of ``model``'s family (a DSA config's ``arch``; else Hermes)."""
    kind = getattr(getattr(model, "config", None), "arch", "")
    if kind == "deepseek_v32":
        return "deepseek_v32"
    if kind == "glm_moe_dsa":
        return "glm"
    return "hermes"


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class ToolReader:
    """How one chat request's answers are read under its ``tool_choice`` (``mode``): whole
    (`message`) or as stream deltas (`delta`), per choice. ``raw(token_ids)`` decodes with
    the special tokens kept (a family's markup may be special tokens, which the plain text
    drops) and without the end-of-sequence token. ``think_end``: the id of the token that ends
    a thinking answer's reasoning (``</think>``; ``None``: the request does not think): what
    comes before it is ``reasoning_content`` (vLLM's reasoning parsers' field), streamed as
    such, the rest the answer."""

    def __init__(
        self, mode: str, name: str | None, parser: str, raw: Any, think_end: int | None = None
    ) -> None:
        self.mode, self.name, self.parse, self.raw = mode, name, PARSERS[parser], raw
        self.think_end = think_end
        self.marker = MARKERS[parser]
        self._shown: dict[int, int] = {}  # raw characters an auto stream has shown
        self._answering: set[int] = set()  # choices past their reasoning (streams)
        self._ids: dict[int, list[int]] = {}
        self._text: dict[int, str] = {}
        self._named: dict[int, ToolCall] = {}

    def message(self, text: str, token_ids: list[int], finish: str | None):
        """``(message, finish_reason)`` of a whole answer."""
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self.think_end is not None:
            ids, end = token_ids, self.think_end
            k = ids.index(end) if end in ids else len(ids)
            msg["reasoning_content"] = self.raw(ids[:k])
            token_ids = ids[k + 1 :]
            msg["content"] = text = self.raw(token_ids)
        calls = self._calls(text, token_ids, finish, msg)
        if calls is None:
            return msg, finish
        msg["tool_calls"] = [c.openai() for c in calls]
        return msg, finish if self.mode == "named" else "tool_calls"

    def _calls(self, text: str, ids: list[int], finish: str | None, msg: dict[str, Any]):
        """The answer's calls (``None``: plain content), setting ``msg["content"]``."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            msg["content"] = None
            if not text and self.think_end is not None:
                return None  # cut short while reasoning: no arguments yet, no call
            return [ToolCall(str(self.name), text)]
        if self.mode == "required":
            if finish != "stop":  # cut short: the array did not close
                return None
            msg["content"] = None
            return required_calls(text)
        content, calls = self.parse(self.raw(ids))
        if not calls:
            return None
        msg["content"] = content
        return calls

    def delta(self, index: int, text: str, token_ids: list[int], finish: str | None):
        """``(delta, finish_reason)`` of one stream step of choice ``index`` (``None``: emit
        nothing yet). Named calls stream their arguments as they come; an ``auto`` answer
        streams its text up to where the family's call markup starts (text that could be the
        start of it waits), its calls when it ends; ``required`` answers, and ``auto`` ones of
        a thinking request, are read whole when they end."""
        if self.mode == "none":
            key = "content"
            if self.think_end is not None and index not in self._answering:
                if self.think_end in token_ids:
                    self._answering.add(index)  # the answer starts (its text: this delta's)
                else:
                    key = "reasoning_content"
            return ({key: text} if text else {}), finish
        if self.mode == "named":
            if self.think_end is not None and index not in self._answering:
                if self.think_end not in token_ids:
                    return ({"reasoning_content": text} if text else {}), finish
                self._answering.add(index)  # the arguments start (their text: this delta's)
            call = self._named.get(index)
            if call is None:
                call = self._named[index] = ToolCall(str(self.name), "")
                part: dict[str, Any] = call.openai(0)
                part["function"]["arguments"] = text
            else:
                part = {"index": 0, "function": {"arguments": text}}
            return ({"tool_calls": [part]} if text or finish is None else {}), finish
        ids = self._ids.setdefault(index, [])
        ids += token_ids
        if self.mode == "auto" and self.think_end is None:
            return self._auto_delta(index, ids, finish)
        self._text[index] = self._text.get(index, "") + text
        if finish is None:
            return None, None
        msg, why = self.message(self._text.pop(index), self._ids.pop(index), finish)
        out: dict[str, Any] = {}
        if msg.get("reasoning_content"):
            out["reasoning_content"] = msg["reasoning_content"]
        if msg.get("content"):
            out["content"] = msg["content"]
        if msg.get("tool_calls"):
            out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        return out, why

    def _auto_delta(self, index: int, ids: list[int], finish: str | None):
        raw = self.raw(ids)
        shown = self._shown.get(index, 0)
        if finish is None:
            at = raw.find(self.marker)
            upto = at if at >= 0 else len(raw) - _partial_suffix(raw, self.marker)
            if upto <= shown:
                return None, None
            self._shown[index] = upto
            return {"content": raw[shown:upto]}, None
        del self._ids[index]
        self._shown.pop(index, None)
        _, calls = self.parse(raw)
        if not calls:
            return ({"content": raw[shown:]} if raw[shown:] else {}), finish
        return {"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}, "tool_calls"


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (and is shorter)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
