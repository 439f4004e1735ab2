"""The OpenAI request bodies the server accepts (pydantic), mapped onto `SamplingParams`.

Field names and defaults follow OpenAI's API; ``top_k``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos`` and ``stop_token_ids`` are accepted as extra fields, as vLLM does. A field these
models do not define is checked by `hisparse.serve.fields`: refused (400) where it would change
the output, else accepted and logged once.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from hisparse.engine.sampling import SamplingParams
from hisparse.engine.structured_params import StructuredOutputsParams
from hisparse.serve.fields import REFUSED_CHAT, REFUSED_COMPLETIONS


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = "response"
    description: str | None = None
    #: OpenAI's name is ``schema``, which pydantic's BaseModel reserves
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` extra field (one of its keys)."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: the fields this route refuses unless neutral (`fields.check_extra_fields`)
    refused: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The structured output this body asks for and the field that asked (a
        `ValueError` naming the field for a bad one or for two at once)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", dict(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError(
                    "response_format: type 'json_schema' needs json_schema.schema, e.g. "
                    '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}'
                )
            asked.append(("response_format", dict(json=rf.json_schema.json_schema)))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = dict(json=so.json_, json_object=so.json_object or None, regex=so.regex,
                         choice=so.choice, grammar=so.grammar)  # fmt: skip
            kwargs = {k: v for k, v in given.items() if v is not None}
            kwargs["disable_any_whitespace"] = so.disable_any_whitespace
            asked.append(("structured_outputs", kwargs))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                asked.append((f"guided_{name}", {name: value}))
        if not asked:
            return None, None
        if len(asked) > 1:
            names = ", ".join(n for n, _ in asked)
            raise ValueError(f"{asked[1][0]}: give one structured output, not several ({names})")
        field, kwargs = asked[0]
        try:
            return StructuredOutputsParams(**kwargs), field
        except (ValueError, TypeError) as e:
            raise ValueError(f"{field}: {e}") from None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """`SamplingParams` of this body (its checks name the field: a ValueError/TypeError
        becomes a 400 answer)."""
        return SamplingParams(
            structured_outputs=structured_outputs,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            n=self.n,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


class CompletionRequest(_Sampling):
    refused = REFUSED_COMPLETIONS
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    #: accepted only equal to ``n`` (every completion is returned; none is picked)
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or token ids (OpenAI accepts a batch in a list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        fn = {"name": self.function.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": fn}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    #: an assistant turn's calls (OpenAI's shape; ``function.arguments`` JSON text)
    tool_calls: list[ToolCallIn] | None = None
    #: a ``tool`` turn: the call it answers
    tool_call_id: str | None = None
    name: str | None = None
    #: an assistant turn's thinking (vLLM's reasoning parsers' field), for templates that
    #: show it
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention): ``content``
        text, tool calls with their arguments as a dict where they parse."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        """The message's text (OpenAI's list-of-parts form: its text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    "messages[].content: only text parts ({'type': 'text', 'text': ...}) are "
                    "supported"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    refused = REFUSED_CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: keyword arguments of the chat template (vLLM's field): ``{"thinking": true}``, ...
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: ``auto`` with
        tools, ``none`` without)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            mode = "named"
        else:
            mode = choice or ("auto" if self.tools else "none")
        if mode in ("named", "required") and not self.tools:
            raise ValueError(f"tool_choice: {mode!r} needs tools; give the tools to choose from")
        return mode

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
