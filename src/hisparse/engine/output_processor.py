"""`OutputProcessor`: appends each sampled token to its request, keeps ``req.text`` decoded and
decides whether the request ends.

Re-decoding a request's whole output on every token costs O(length) per token (over a
millisecond per request per step at 8,192 tokens); this module decodes a window of a few
tokens per step instead, with the same text as the full decode at every step, so output
processing stays O(1) per token (amortized) however long the output grows.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hisparse.engine.request import Request

_FFFD = "\ufffd"
#: decoders (``tokenizers`` JSON ``type``) whose output for a token depends on the tokens
#: before it only through the byte / byte-token run it belongs to and the strip of the first
#: token's leading space: a window starting at a committed boundary decodes as the whole does
_LOCAL_DECODERS = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse"})


@dataclass(slots=True)
class DetokenizerState:
    """One request's incremental decoding (``req.detokenizer``).

    ``req.text[:committed]`` is final (the text of ``ids[:read]``): no later token changes
    it. The window ``ids[prefix:]`` is decoded each step; ``prefix_text`` is the decode of
    ``ids[prefix:read]`` (committed tokens kept as context, so that the window decodes its
    new tokens as the whole output would: a merge, a split character, a leading space), and
    what the window decodes past ``prefix_text`` follows the committed text.
    """

    #: output tokens seen (another count: the list changed elsewhere, start over)
    n: int = 0
    prefix: int = 0
    read: int = 0
    prefix_text: str = ""
    committed: int = 0
    #: ``id`` and length of the ``req.text`` this state set last (another: start over)
    text_id: int = 0
    text_len: int = 0


class OutputProcessor:
    """Appends a sampled token to its request and decides whether the request ends: a stop
    token id, an end-of-sequence token (unless ``ignore_eos``), a stop string in the text
    (cut before it, or after it with ``include_stop_str_in_output``), ``max_tokens`` or
    ``max_model_len``; nothing stops before ``min_tokens``. Keeps ``req.text`` equal to
    ``tokenizer.decode(req.output_token_ids, skip_special_tokens=True)`` (``""`` without a
    tokenizer). (It replaced a checker that decoded the whole output every token.)

    Decoding is incremental (vLLM's prefix / read offsets): each step decodes the few tokens
    of a window (the last committed tokens as context, then the new ones) and appends what it
    adds past the context; text that a later token may still change (a trailing U+FFFD: a
    character whose bytes have not all come) stays in the window, and ``req.text`` shows it
    as the full decode would. ``req.text`` grows in place where nothing else holds it
    (CPython resizes a string with one reference), so the text is not copied every token.

    This is exact for a ``tokenizers.Tokenizer`` (or a `GgufTokenizer`, or a transformers
    fast tokenizer without ``clean_up_tokenization_spaces``) whose decoder is made of
    ByteLevel, Metaspace, ByteFallback, Fuse, a one-character Replace and a Strip of at most
    one leading character (GPT-2 / Llama 3 / Qwen / SmolLM2 byte-level BPE; Llama 2 /
    Mistral / Gemma SentencePiece). Any other tokenizer (WordPiece, CTC, a BPE suffix
    decoder, a decoder written in Python, transformers' space clean-up, an object that is
    not a ``tokenizers`` one) falls back to decoding the whole output each step: correct,
    O(length) per token, as before.

    ByteFallback decodes a run of byte tokens (``<0xE4>``; special tokens between them are
    skipped) all at once: while the run ends inside a character every byte of it decodes to
    U+FFFD, text shown before included. The window therefore keeps a whole run, committing
    only after a token that ends it: O(run length) per token during a run, as the text
    itself changes that much. A window also grows while its text ends in U+FFFD (a
    character not complete yet, or garbage bytes): O(1) per token holds for valid UTF-8
    text. Should a window ever decode inconsistently with its context (it does not for the
    decoders admitted), the request's state restarts from the first token (one full decode)
    and stays exact.

    Stop strings are searched only from where the text changed (the new text, or a
    trailing U+FFFD now completed) less ``max(len(stop)) - 1`` characters.

    A preempted request keeps its output tokens and text, so its state stays valid; a
    request whose ``output_token_ids`` or ``text`` changed elsewhere is decoded afresh.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        backend = incremental_backend(tokenizer)
        #: the window's decode (``None``: decode the whole output each step)
        self._decode: Callable[[list[int]], str] | None = None
        #: ids after which a byte-fallback run may go on (byte tokens, skipped special ones);
        #: ``None``: the decoder has no ByteFallback
        self._run_ids: frozenset[int] | None = None
        if backend is not None:
            self._decode = _skipping_decode(backend)
            if "ByteFallback" in _decoder_types(_decoder_config(backend)):
                ids = {backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
                added = backend.get_added_tokens_decoder().items()
                ids |= {i for i, t in added if t.special}
                self._run_ids = frozenset(i for i in ids if i is not None)

    @property
    def incremental(self) -> bool:
        """Whether the text is decoded incrementally (else: the whole output each step)."""
        return self._decode is not None

    def append(
        self, req: Request, token: int, logprobs: dict[int, float] | None, now: float
    ) -> str | None:
        """Append ``token``; the finish reason (``"stop"``, ``"length"``) or ``None``."""
        req.output_token_ids.append(token)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob = (req.cumulative_logprob or 0.0) + logprobs.get(token, 0.0)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.metrics.token_times.append(now)
        changed = 0  # the text before this index did not change
        if self._decode is not None:
            changed = self._step(req)
        elif self.tokenizer is not None:
            before = req.text
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            changed = _common_prefix_len(before, req.text)
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:  # no stop before min_tokens
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if p.stop and self.tokenizer is not None:
                # the changed text and what a stop string may share with the text before it
                start = max(changed - max(len(s) for s in p.stop) + 1, 0)
                text = req.text
                hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
                if hits:
                    cut, req.stop_reason = min(hits)
                    keep = len(req.stop_reason) if p.include_stop_str_in_output else 0
                    req.text = text[: cut + keep]
                    return "stop"
        if (p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens) or (
            req.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    def _step(self, req: Request) -> int:
        """Decode the window after the newest token into ``req.text``; the index from which
        the text changed."""
        decode = self._decode
        assert decode is not None
        ids = req.output_token_ids
        n = len(ids)
        text = req.text
        st = req.detokenizer
        if (
            not isinstance(st, DetokenizerState)
            or st.n != n - 1
            or st.text_len != len(text)
            or st.text_id != id(text)
        ):
            st = req.detokenizer = DetokenizerState()  # from the first token
        window = decode(ids[st.prefix :])
        if not window.startswith(st.prefix_text):  # not for the decoders admitted
            st = req.detokenizer = DetokenizerState()
            window = decode(ids)
        added = window[len(st.prefix_text) :]
        # the text changes from the end of what was final, or later
        changed = c = st.committed
        if len(text) != c:  # a tail that was not final: replaced
            changed += _common_prefix_len(text[c:], added)
            text = text[:c]
        if added:
            # the only reference: CPython grows the string in place (amortized O(1))
            # instead of copying the whole text every token
            req.text = ""
            text += added
        req.text = text
        # commit when the new context holds a token with text, no character waits for more
        # bytes and no byte-fallback run may go on
        if (
            len(window) > len(st.prefix_text)
            and not window.endswith(_FFFD)
            and (self._run_ids is None or ids[-1] not in self._run_ids)
        ):
            st.committed = len(text)
            st.prefix_text = window if st.prefix == st.read else decode(ids[st.read :])
            st.prefix, st.read = st.read, n
        st.n, st.text_id, st.text_len = n, id(text), len(text)
        return changed


def incremental_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` whose ``decode(ids, skip_special_tokens=True)`` is
    ``tokenizer``'s and decodes a window as the whole output does; ``None`` where there is
    none (no tokenizer, another kind, a decoder that is not local)."""
    if tokenizer is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return None
    backend: Any = None
    if isinstance(tokenizer, Tokenizer):
        backend = tokenizer
    elif _is_gguf_tokenizer(tokenizer):
        backend = tokenizer.backend
    elif getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers one
    if not isinstance(backend, Tokenizer) or not _local(_decoder_config(backend)):
        return None
    return backend


def _is_gguf_tokenizer(tokenizer: Any) -> bool:
    """A `GgufTokenizer` whose ``decode`` is its backend's (looked up without importing its
    module, which imports torch: a tokenizer of that class means the module is loaded)."""
    cls = getattr(sys.modules.get("hisparse.models.tokenizer"), "GgufTokenizer", None)
    return cls is not None and isinstance(tokenizer, cls) and type(tokenizer).decode is cls.decode


def _decoder_config(backend: Any) -> Any:
    """The backend's decoder as its JSON (``None``: no decoder, or one that cannot say)."""
    decoder = backend.decoder
    if decoder is None:
        return None
    try:
        return json.loads(decoder.__getstate__())
    except Exception:  # a decoder written in Python
        return None


def _local(config: Any) -> bool:
    if not isinstance(config, dict):
        return False
    kind = config.get("type")
    if kind == "Sequence":
        parts = config.get("decoders")
        return isinstance(parts, list) and bool(parts) and all(map(_local, parts))
    if kind == "Replace":  # one character cannot straddle two tokens
        pattern = config.get("pattern")
        return isinstance(pattern, dict) and len(pattern.get("String") or "") == 1
    if kind == "Strip":  # at most the first character, which the context holds
        return config.get("stop") == 0 and config.get("start") in (0, 1)
    return kind in _LOCAL_DECODERS


def _decoder_types(config: Any) -> set[str]:
    if not isinstance(config, dict):
        return set()
    parts = config.get("decoders") if config.get("type") == "Sequence" else None
    if isinstance(parts, list):
        return set().union(*map(_decoder_types, parts))
    return {str(config.get("type"))}


def _skipping_decode(backend: Any) -> Callable[[list[int]], str]:
    def decode(ids: Sequence[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    return decode


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
