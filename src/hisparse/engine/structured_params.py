"""`StructuredOutputsParams`: the shape a completion must take (vLLM's ``structured_outputs``:
a JSON schema, any JSON object, a regular expression, one of several strings, or an EBNF
grammar). Kept apart from the grammar machinery (`hisparse.engine.grammar`, which needs
xgrammar) so that `SamplingParams` and the scheduler import neither torch nor xgrammar."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hisparse.validation import _fail

#: at most this many alternatives in ``choice`` (each becomes a branch of the grammar)
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields: the output is constrained to it, token by token, by a mask
    on the sampler's logits (docs/design.md §14.1).

    Args:
        json: a JSON schema (a dict or its JSON text); the output is one JSON value valid
            under it (strict: no properties beyond the schema's).
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, root rule ``root``).
        disable_any_whitespace: JSON without free whitespace (one space after ``:`` and
            ``,``, no newlines), as vLLM's field of that name; by default JSON may hold any
            whitespace between tokens, at most `grammar.MAX_WHITESPACE` characters in a row.
        after_token: the constraint starts after this token id is sampled, everything before
            it free: a thinking model's end of reasoning (``</think>``), as vLLM's reasoning
            parsers hold the grammar until the reasoning ends (the server sets it for a
            thinking request's tool choice); ``None``: from the first token.
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    after_token: int | None = None

    def __post_init__(self) -> None:
        f = "StructuredOutputsParams."
        t = self.after_token
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            _fail(f + "after_token", t, "a token id (an int >= 0) or None",
                  type_error=not isinstance(t, int) or isinstance(t, bool))  # fmt: skip
        if not isinstance(self.disable_any_whitespace, bool):
            _fail(f + "disable_any_whitespace", self.disable_any_whitespace, "True or False",
                  type_error=True)  # fmt: skip
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            _fail(f + "json_object", self.json_object, "True or False", type_error=True)
        if len(given) != 1:
            _fail(
                "StructuredOutputsParams", given, "exactly one of json, json_object, regex, "
                "choice or grammar", example="StructuredOutputsParams(json={'type': 'object'})",
            )  # fmt: skip
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    _fail(f + "json", self.json, f"a JSON schema (it is not JSON: {e})")
            elif isinstance(self.json, Mapping):
                schema = dict(self.json)
            else:
                _fail(f + "json", self.json, "a JSON schema: a dict or its JSON text",
                      type_error=True)  # fmt: skip
            if not isinstance(schema, dict | bool):
                _fail(f + "json", self.json, "a JSON schema (an object or a boolean)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f + name, value, "a non-empty string", type_error=not isinstance(value, str))
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str | bytes | Mapping) or not isinstance(c, Sequence):
                _fail(f + "choice", c, "a list of strings", type_error=True)
            if not c or len(c) > MAX_CHOICES:
                _fail(f + "choice", c, f"a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(s, str) and s for s in c):
                _fail(f + "choice", c, "a list of non-empty strings", type_error=True)
            object.__setattr__(self, "choice", tuple(c))

    @property
    def kind(self) -> str:
        """Which field is set: ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k))

    def key(self) -> tuple[str, str, bool]:
        """A hashable form of the constraint (the compiled-grammar cache's key)."""
        kind, compact = self.kind, self.disable_any_whitespace
        if kind == "json":
            value = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return kind, json.dumps(json.loads(value), sort_keys=True), compact
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ())), compact
        if kind == "json_object":
            return kind, "", compact
        return kind, str(getattr(self, kind)), compact
