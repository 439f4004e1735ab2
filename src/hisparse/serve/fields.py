"""Request fields the server does not implement: refused when they would change the output,
accepted and logged once when they would not (docs/design.md §15.1).

Silently dropping a field a client relies on (``logit_bias``, ``suffix``, beam search, ...)
gives it an answer it did not ask for; vLLM logs fields it ignores, and so does this server
for the harmless ones (``user``, ``metadata``, ``store``, ...). A refused field is accepted at
its neutral value (``null``, or the value that means "off"), so clients that always send a
default still work.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hisparse.serve")

#: fields accepted at these values only (what the output is without the feature); any other
#: value is a 400 naming the field. Both routes.
REFUSED_COMMON: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "logit_bias": (None, {}),
    # vLLM's extra sampling fields
    "min_p": (None, 0, 0.0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "logits_processors": (None, []),
    "structural_tag": (None,),
    "return_tokens_as_token_ids": (None, False),
    "add_special_tokens": (None,),
    "guided_decoding_backend": (None, "xgrammar"),
    "guided_whitespace_pattern": (None,),
    "vllm_xargs": (None, {}),
}
REFUSED_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    **REFUSED_COMMON,
    "suffix": (None, ""),
}
REFUSED_CHAT: dict[str, tuple[Any, ...]] = {
    **REFUSED_COMMON,
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None, []),
    "chat_template": (None,),
    "mm_processor_kwargs": (None, {}),
}
#: fields that do not change the output: accepted, logged once per name
HARMLESS: frozenset[str] = frozenset({
    "user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "moderation",
    "priority", "request_id", "cache_salt", "kv_transfer_params", "return_token_ids",
})  # fmt: skip

_logged: set[str] = set()


def check_extra_fields(extra: dict[str, Any], refused: dict[str, tuple[Any, ...]]) -> str | None:
    """The first field of ``extra`` (the body's fields the request model does not define)
    that changes the output and is not implemented, or ``None``; the others are logged once
    each (harmless ones as accepted, unknown ones as ignored)."""
    for name, value in extra.items():
        if name in refused:
            if not any(_same(value, ok) for ok in refused[name]):
                return name
        elif name not in _logged:
            _logged.add(name)
            what = "accepted (it does not change the output)" if name in HARMLESS else (
                "ignored: this server does not know it")  # fmt: skip
            log.warning("request field %r %s", name, what)
    return None


def _same(value: Any, ok: Any) -> bool:
    if ok is None or isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    return value == ok
