"""Structured outputs (docs/design.md §14.1): a request's `StructuredOutputsParams` compiled by
xgrammar (the grammar library vLLM and SGLang use) into a grammar over the model's
vocabulary, a matcher per request that follows its tokens, and each step a token bitmask per
constrained row applied to the logits on the device inside the sampler.

A grammar row needs its sampled token accepted before its next mask exists, so async
scheduling steps aside for a step that holds one (`AsyncEngineCore._deferrable`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence, Set
from typing import Any

import torch

from hisparse.engine.host_copy import tensor_to_device
from hisparse.engine.output_processor import _decoder_config, _decoder_types
from hisparse.engine.structured_params import StructuredOutputsParams

#: compiled grammars kept per engine (a JSON schema compiles in milliseconds to a second;
#: agents send the same few schemas again and again)
CACHE_SIZE = 256
#: most whitespace characters in a row between JSON tokens: any layout a model writes (2- or
#: 4-space indents a few levels deep), but a model that loops on newlines cannot run its
#: answer to ``max_tokens`` without closing it
MAX_WHITESPACE = 16


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise ValueError(
            "structured outputs need the xgrammar package: pip install 'hisparse[serve]'"
        ) from None
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Set[int]) -> Any:
    """xgrammar's view of the vocabulary: each id's token as the tokenizer spells it (special
    tokens and ids past the tokenizer's vocabulary empty, so the grammar never allows them),
    the spelling's kind (byte-level, byte-fallback or raw) and the stop tokens."""
    xgr = _xgrammar()
    backend = getattr(tokenizer, "backend", tokenizer)  # a GgufTokenizer or tokenizers'
    encoded = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            encoded[i] = token
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and 0 <= i < vocab_size:
            encoded[i] = ""
    types = _decoder_types(_decoder_config(backend))
    if "ByteLevel" in types:
        kind = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in types:
        kind = xgr.VocabType.BYTE_FALLBACK
    else:
        kind = xgr.VocabType.RAW
    stops = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=stops or None)


class Grammars:
    """Compiled grammars of one engine's tokenizer, the most recent `CACHE_SIZE` kept, and
    the matchers made from them. Thread-safe: the server compiles in its handlers (so a bad
    schema answers 400 before anything is queued) while the engine loop runs."""

    def __init__(self, tokenizer: Any, model: Any, eos_token_ids: Set[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, int(model.config.vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """``spec``'s compiled grammar (cached); a `ValueError` naming the field when xgrammar
        cannot compile it (an unsupported schema keyword, a malformed regex or grammar)."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self.tokenizer is None:
                raise ValueError(
                    "structured outputs need the model's tokenizer (this checkpoint has no "
                    "tokenizer.json)"
                )
            if self._compiler is None:
                xgr = _xgrammar()
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        kind = key[0]
        try:
            compiled = _compile(self._compiler, kind, spec)
        except (RuntimeError, ValueError, TypeError, re.error) as e:
            raise ValueError(
                f"structured_outputs.{kind}: cannot be compiled into a grammar: {e}"
            ) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher of ``spec``'s grammar (one per completion: it follows its tokens);
        with ``spec.after_token``, one that lets every token through until that token
        (`AfterToken`)."""
        matcher = _xgrammar().GrammarMatcher(self.compile(spec))
        return matcher if spec.after_token is None else AfterToken(matcher, spec.after_token)


class AfterToken:
    """A grammar matcher held open until ``token`` is sampled (a thinking answer's end of
    reasoning): until then every token is allowed and none reaches ``matcher``; from the
    token after it, ``matcher`` rules."""

    def __init__(self, matcher: Any, token: int) -> None:
        self.matcher, self.token, self.started = matcher, token, False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)  # every bit set: every token allowed

    def accept_token(self, token: int) -> bool:
        if self.started:
            return bool(self.matcher.accept_token(token))
        self.started = token == self.token
        return True


def _compile(compiler: Any, kind: str, spec: StructuredOutputsParams) -> Any:
    if kind in ("json", "json_object"):
        schema = '{"type": "object"}' if kind == "json_object" else spec.json
        if not isinstance(schema, str):
            schema = json.dumps(schema)
        if spec.disable_any_whitespace:
            space: dict[str, Any] = dict(any_whitespace=False)
        else:
            space = dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
        ebnf = str(
            _xgrammar().Grammar.from_json_schema(schema, strict_mode=kind == "json", **space)
        )
        return compiler.compile_grammar(json_string_fix(ebnf))
    if kind == "regex":
        re.compile(str(spec.regex))  # Python's message for a malformed one
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(spec.grammar)


#: xgrammar's character class for the characters of a length-bounded JSON string (its
#: ``maxLength`` / ``minLength`` rules), which admits the raw control characters U+0000 to
#: U+001F that JSON forbids inside strings (its other strings exclude them); and the fix
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_string_fix(ebnf: str) -> str:
    """``ebnf`` (xgrammar's text of a JSON schema's grammar) with the characters of every
    string limited to what JSON allows unescaped."""
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def apply_grammar_masks(x: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
    """Set to ``-inf``, in place, the logits of ``x [B, V]`` (fp32) that each grammar row
    ``rows[j]`` may not take next, from ``matchers[j]``'s bitmask: the rows' bitmasks filled
    on the host, one copy to the device, one batched xgrammar kernel there (its CPU, CUDA or
    Triton kernel; `unpack_bitmask` is the torch reference)."""
    xgr = _xgrammar()
    V = x.shape[-1]
    bitmask = xgr.allocate_token_bitmask(x.shape[0], V)
    for i, m in zip(rows, matchers, strict=True):
        m.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(x, tensor_to_device(bitmask, x.device), indices=list(rows))


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bits [R, ceil(V/32)]`` int32 (bit ``b`` of word ``w``: token ``32 w + b`` allowed,
    xgrammar's layout) as a bool ``[R, V]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits[:, :, None] >> shifts) & 1
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab].bool()
