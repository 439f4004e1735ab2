"""One validation layer for the public API: `LLM`'s arguments, `SamplingParams`,
`HiSparseConfig`, prompts and chat messages (and, through them, the CLI's flags).

Every check raises one of two errors, each naming the field, the value and what would work:

* `HiSparseTypeError` for a value of the wrong type (``SamplingParams(stop=[1])``). It is a
  `TypeError`, and also a `HiSparseConfigError` (a `ValueError`), so code that catches
  ``ValueError`` for any bad argument (the CLI does) still catches it.
* `HiSparseConfigError` (a `ValueError`) for a value of the right type that cannot work
  (out of range, NaN, infinite, too large for the machine or the model).

The errors keep ``field`` (qualified, e.g. ``"SamplingParams.max_tokens"``), ``value``,
``requirement`` and ``example``, so the CLI can name the flag instead (`hisparse.cli`).

A request's own input (its prompt's text or token ids) is checked by `prompt_token_ids`,
which returns an error message instead of raising: a bad prompt fails its own request only.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class HiSparseConfigError(ValueError):
    """A value HiSparse cannot run with; the message names the field and what would work."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        value: Any = None,
        requirement: str | None = None,
        example: Any = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.requirement = requirement
        self.example = example


class HiSparseTypeError(HiSparseConfigError, TypeError):
    """A value of the wrong type (a `TypeError`; also a `HiSparseConfigError`)."""


def _fail(
    field: str, value: Any, requirement: str, *, example: Any = None, type_error: bool = False
) -> None:
    name = field.rsplit(".", 1)[-1]
    hint = "" if example is None else f", e.g. {name}={example!r}"
    cls = HiSparseTypeError if type_error else HiSparseConfigError
    raise cls(
        f"{field}={_show(value)} must be {requirement}{hint}.",
        field=field,
        value=value,
        requirement=requirement,
        example=example,
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _range_text(minimum: float | None, maximum: float | None, *, open_min: bool = False) -> str:
    if minimum is not None and maximum is not None:
        lo = "(" if open_min else "["
        return f"in {lo}{minimum}, {maximum}]"
    if minimum is not None:
        return f"{'>' if open_min else '>='} {minimum}"
    if maximum is not None:
        return f"<= {maximum}"
    return ""


def is_integer(value: Any) -> bool:
    """An int (or numpy integer), not a bool."""
    if isinstance(value, bool) or (hasattr(value, "dtype") and value.dtype == bool):  # np.bool_
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(
    field: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    example: int | None = None,
    optional: bool = False,
    what: str = "",
) -> int | None:
    """``value`` as an int in ``[minimum, maximum]`` (``None`` allowed when ``optional``)."""
    if minimum in (0, 1):
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        kind += "" if maximum is None else f" <= {maximum}"
    else:
        kind = f"an integer {_range_text(minimum, maximum)}".rstrip()
    if value is None and optional:
        return None
    if not is_integer(value):
        req = kind + what + (" or None" if optional else "")
        _fail(field, value, req, example=example, type_error=True)
    v = operator.index(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        _fail(field, v, kind + what, example=example)
    return v


def check_float(
    field: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_min: bool = False,
    example: float | None = None,
    optional: bool = False,
    what: str = "",
) -> float | None:
    """``value`` as a finite float in its range (``open_min``: ``> minimum``)."""
    if minimum == 0 and open_min:
        kind = "a positive, finite number"  # a maximum, if any, is told in ``what``
    else:
        kind = f"a finite number {_range_text(minimum, maximum, open_min=open_min)}".rstrip()
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        req = kind + what + (" or None" if optional else "")
        _fail(field, value, req, example=example, type_error=True)
    try:
        v = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        v = math.inf if value > 0 else -math.inf
    bad = not math.isfinite(v)
    bad = bad or (minimum is not None and (v <= minimum if open_min else v < minimum))
    bad = bad or (maximum is not None and v > maximum)
    if bad:
        _fail(field, value, kind + what, example=example)
    return v


#: The largest memory size a GiB setting takes (2**40 GiB): larger finite floats would not
#: convert to a byte count; the memory checks refuse anything above the machine long before.
MAX_GIB = 2**40


def check_gib(field: str, value: Any, *, optional: bool = False, example: float | None = None):
    """A memory size: a positive, finite number of GiB (at most `MAX_GIB`)."""
    return check_float(
        field, value, minimum=0, open_min=True, maximum=MAX_GIB, example=example,
        optional=optional, what=" of GiB (at most 2**40)",
    )  # fmt: skip


def check_bool(field: str, value: Any, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool) and not (hasattr(value, "dtype") and value.dtype == bool):
        _fail(field, value, "True or False" + (" or None" if optional else ""), type_error=True)
    return bool(value)


def check_choice(field: str, value: Any, choices: Sequence[str]) -> str:
    listed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        _fail(field, value, f"one of {listed}", type_error=True)
    if value not in choices:
        _fail(field, value, f"one of {listed}")
    return value


# -- dtypes ------------------------------------------------------------------------------------

#: ``dtype`` names `LLM` takes (torch's and the usual short ones) and the torch dtype each
#: means (by name: this module imports no torch, so the scheduler's imports stay torch-free).
DTYPE_NAMES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def _is_tensor(value: Any) -> bool:
    """``value`` is a torch tensor (without importing torch: none exists unless it is)."""
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(value, torch_mod.Tensor)


def check_dtype(field: str, value: Any) -> torch.dtype | None:
    """A model dtype: one of `DTYPE_NAMES` or a float32/bfloat16/float16 ``torch.dtype``;
    ``None`` for ``"auto"``."""
    import torch

    allowed = "'auto', 'float32', 'bfloat16', 'float16' (or fp32, bf16, fp16, half, float) or "
    allowed += "torch.float32 / torch.bfloat16 / torch.float16"
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            _fail(field, value, allowed)
        return value
    if not isinstance(value, str):
        _fail(field, value, allowed, type_error=True)
    key = value.lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        _fail(field, value, allowed)
    name = DTYPE_NAMES[key]
    return None if name is None else getattr(torch, name)


# -- requests ----------------------------------------------------------------------------------


def prompt_token_ids(ids: Any, vocab_size: int, max_model_len: int) -> list[int] | str:
    """A request's token ids as a list, or the message that fails that request (not the
    others): not a list of integers, empty, outside the vocabulary, or no room for output."""
    if isinstance(ids, str | bytes) or not (isinstance(ids, Sequence) or _is_tensor(ids)):
        return (
            f"the prompt's token ids must be a list of integers, got {type(ids).__name__}; "
            "pass text as a prompt instead"
        )
    if _is_tensor(ids):
        ids = ids.tolist() if ids.dim() == 1 else [ids]
    out = []
    for t in ids:
        if not is_integer(t):
            return f"the prompt's token ids must be integers, got {_show(t)}"
        out.append(operator.index(t))
    if not out:
        return "the prompt is empty; give at least one token"
    bad = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"the prompt has token ids outside the vocabulary [0, {vocab_size}) (e.g. {bad})"
    if len(out) >= max_model_len:
        return (
            f"the prompt has {len(out)} tokens, but max_model_len={max_model_len} (the "
            f"--max-model-len flag) leaves room for at most {max_model_len - 1} and one of "
            "output: shorten the prompt, or raise max_model_len where the model's context allows"
        )
    return out


def is_token_list(value: Any) -> bool:
    """A flat list of token ids (one prompt), as opposed to a list of prompts."""
    if _is_tensor(value):
        return value.dim() == 1
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and len(value) > 0
        and is_integer(value[0])
    )


def check_max_model_len(max_model_len: int | None, model_max_len: int) -> None:
    """``LLM.max_model_len`` within the model's context limit (``max_position_embeddings``)."""
    if max_model_len is not None and max_model_len > model_max_len:
        _fail(
            "LLM.max_model_len", max_model_len,
            f"at most the model's context limit of {model_max_len} tokens "
            "(max_position_embeddings)",
        )  # fmt: skip


#: The roles a chat message may have: the OpenAI API's, as the server's request model takes
#: them (`hisparse.serve.protocol`); `LLM.chat` checks the same.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_conversations(messages: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    """``messages`` of `LLM.chat`: one conversation (a list of ``{"role", "content"}``
    dicts) or a list of them. Returns the conversations and whether a single one was given;
    raises `HiSparseConfigError` / `HiSparseTypeError` naming the bad message."""
    shape = 'a list of {"role": str, "content": str} dicts, or a list of such lists'
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        _fail("messages", messages, shape, type_error=True)
    if not messages:
        _fail("messages", messages, "a non-empty conversation: " + shape)
    single = isinstance(messages[0], Mapping)
    convs = [messages] if single else list(messages)
    out = []
    for ci, conv in enumerate(convs):
        where = "messages" if single else f"messages[{ci}]"
        if isinstance(conv, str | bytes | Mapping) or not isinstance(conv, Sequence):
            _fail(where, conv, 'a list of {"role": str, "content": str} dicts', type_error=True)
        if not conv:
            _fail(where, conv, "a non-empty list of messages")
        checked = []
        for mi, msg in enumerate(conv):
            at = f"{where}[{mi}]"
            if not isinstance(msg, Mapping):
                _fail(at, msg, 'a dict {"role": str, "content": str}', type_error=True)
            for key in ("role", "content"):
                if key not in msg:
                    _fail(at, dict(msg), f"a dict with a {key!r} key (and a string value)")
                if not isinstance(msg[key], str):
                    _fail(f"{at}[{key!r}]", msg[key], "a string", type_error=True)
            if msg["role"] not in CHAT_ROLES:
                roles = ", ".join(repr(r) for r in CHAT_ROLES)
                _fail(f"{at}['role']", msg["role"], f"one of {roles}", example="user")
            checked.append(dict(msg))
        out.append(checked)
    return out, single
