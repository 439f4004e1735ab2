"""Tokenizer and chat template of a GGUF file, built from its metadata alone.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types and special
ids under ``tokenizer.ggml.*``, and the chat template under ``tokenizer.chat_template``. This
module rebuilds the byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) with the
``tokenizers`` library and renders the template with ``jinja2`` the way transformers does
(sandboxed, ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception``, ``tojson``).

Pre-tokenization follows ``tokenizer.ggml.pre`` as llama.cpp does: ``smollm`` splits every
digit on its own before the GPT-2 split (as SmolLM2's own ``tokenizer.json``); ``llama-bpe`` /
``llama3`` use the Llama 3 split; anything else the GPT-2 split.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from hisparse.models.gguf_loader import GgufError, GgufFile, read_gguf

#: llama.cpp token types.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKENIZER_KEYS = (
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class GgufTokenizer:
    """Byte-level BPE tokenizer plus chat template from one GGUF file's metadata."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GgufError(
                f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(m.split(" ")) for m in metadata.get("tokenizer.ggml.merges") or []]
        bad = next((m for m in merges if len(m) != 2), None)
        if bad is not None:
            raise GgufError(f"tokenizer.ggml.merges holds {' '.join(bad)!r}, not a pair")
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab = {
            (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i
            for i, t in enumerate(tokens)
        }
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tk.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "")))
        tk.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == TOKEN_CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == TOKEN_USER_DEFINED
        ]
        if control:
            tk.add_special_tokens(control)
        if user:
            tk.add_tokens(user)
        self.backend = tk
        self.tokens = tokens
        self.special_ids = frozenset(i for i, ty in enumerate(types) if ty == TOKEN_CONTROL)
        self.bos_token_id = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self.eos_token_id = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
        self.pad_token_id = _opt_int(metadata.get("tokenizer.ggml.padding_token_id"))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")

    @classmethod
    def from_gguf(cls, source: str | Path | GgufFile) -> GgufTokenizer:
        gf = source if isinstance(source, GgufFile) else read_gguf(source, keys=_TOKENIZER_KEYS)
        if "tokenizer.ggml.tokens" not in gf.metadata:
            raise GgufError(f"{gf.path.name} holds no tokenizer (tokenizer.ggml.tokens)")
        return cls(gf.metadata)

    # --- tokens ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.tokens[self.eos_token_id]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) stay whole.

        ``add_special_tokens`` adds BOS / EOS where the file asks for them.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a generated answer (EOS)."""
        return [] if self.eos_token_id is None else [self.eos_token_id]

    # --- chat --------------------------------------------------------------------------------
    @property
    def template(self) -> ChatTemplate | None:
        """The compiled chat template, or None when the file has none."""
        return self._template if self.chat_template else None

    @cached_property
    def _template(self) -> ChatTemplate:
        if not self.chat_template:
            raise GgufError("this GGUF file has no tokenizer.chat_template")
        return ChatTemplate(self.chat_template, self.bos_token or "", self.eos_token or "")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``)."""
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes any BOS itself)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class ChatTemplate:
    """A Hugging Face chat template (jinja), rendered the way transformers renders it:
    sandboxed, ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception``, ``tojson``,
    ``strftime_now``; ``bos_token`` / ``eos_token`` given to the template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **_: Any) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint folder: ``chat_template.jinja``, or
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
    the ``default`` one); ``None`` when it has none."""
    folder = Path(folder)
    config: dict[str, Any] = {}
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        config = json.loads(cfg_file.read_text())
    source: Any = None
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source:
        return None

    def token(key: str) -> str:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        return value if isinstance(value, str) else ""

    return ChatTemplate(source, token("bos_token"), token("eos_token"))


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


class CheckpointTokenizer:
    """A checkpoint folder's ``tokenizer.json`` (a ``tokenizers.Tokenizer``) with the
    methods vLLM code calls on ``llm.get_tokenizer()``, as `GgufTokenizer` has them:
    ``encode`` gives a list of ids, ``decode`` text, ``apply_chat_template`` the prompt."""

    def __init__(self, backend: Any, template: ChatTemplate | None) -> None:
        self.backend = backend
        self.template = template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:  # fmt: skip
        """The prompt text for ``messages`` through the checkpoint's chat template."""
        if self.template is None:
            raise ValueError("this checkpoint has no chat template")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def api_tokenizer(tokenizer: Any, template: ChatTemplate | None) -> Any:
    """What `LLM.get_tokenizer` returns: a GGUF model's tokenizer as it is, a checkpoint's
    wrapped (`CheckpointTokenizer`); none is a `ValueError`."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json; send token ids instead")
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer
    return CheckpointTokenizer(tokenizer, template)
