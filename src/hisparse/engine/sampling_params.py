"""`SamplingParams`: how to pick each new token and when to stop (vLLM's names and
semantics), checked when made. Kept apart from the sampler so that the scheduler and the
request objects it handles import no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from hisparse.engine.structured_params import StructuredOutputsParams
from hisparse.validation import _fail, check_bool, check_float, check_int, is_integer

#: Bounds on what one request may ask for, so that no single request can take the engine:
#: ``n`` completions are ``n`` requests of their own (OpenAI caps ``n`` at 128);
#: every new token is searched for each stop string and checked against each stop id.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop (the fields and semantics of vLLM's
    ``SamplingParams`` that hisparse implements).

    Every field is checked when the object is made: a wrong type raises a `TypeError`, a
    value out of range a `ValueError`, each naming the field and what would work.

    Args:
        temperature: ``0`` is greedy; otherwise logits are divided by it before sampling.
        top_p: keep the smallest set of most likely tokens whose probability reaches it
            (``1`` = off), in ``(0, 1]``.
        top_k: keep the ``top_k`` most likely tokens (``0`` or ``-1`` = off).
        min_p: keep only the tokens at least ``min_p`` times as likely as the most likely
            one (after temperature; ``0`` = off), in ``[0, 1]``.
        max_tokens: most new tokens (``None``: up to ``max_model_len``).
        stop: strings that end the generation; the text is cut before the stop string. At
            most `MAX_STOP_STRINGS` of at most `MAX_STOP_CHARS` characters.
        include_stop_str_in_output: keep the stop string that ended the text in it.
        stop_token_ids: token ids that end the generation (the token stays in ``token_ids``),
            at most `MAX_STOP_TOKEN_IDS`.
        seed: makes this request's random draws reproducible whatever runs beside it; with
            ``n > 1`` completion ``i`` draws from a generator seeded from ``(seed, i)``.
        ignore_eos: go on past the model's end-of-sequence tokens.
        n: completions of the prompt (each is prefilled separately: no prefix sharing yet),
            at most `MAX_N`.
        min_tokens: the end-of-sequence tokens and ``stop_token_ids`` cannot be sampled, and
            ``stop`` strings are not looked for, before this many new tokens.
        logprobs: with a number ``k``, each new token gets a dict ``{token_id: logprob}`` of
            the sampled token and the ``k`` most likely ones, log-probabilities of the
            model's raw distribution (before penalties, temperature, top-k and top-p, as
            vLLM's default ``raw_logprobs``). ``None``: no logprobs.
        repetition_penalty: tokens seen in the prompt or the output have a positive logit
            divided by it and a negative one multiplied by it (``1`` = off), ``> 0``.
        presence_penalty: subtracted from the logit of every token already in the output,
            in ``[-2, 2]``.
        frequency_penalty: subtracted from a token's logit once per time it is already in
            the output, in ``[-2, 2]``.
        structured_outputs: a `StructuredOutputsParams` the output must follow (a JSON
            schema, any JSON object, a regex, a choice, a grammar); ``None``: free text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        f = "SamplingParams."
        top_k = check_int(f + "top_k", self.top_k, minimum=-1, example=50, what=" (0, -1: off)")
        checked = dict(
            temperature=check_float(
                f + "temperature", self.temperature, minimum=0, example=0.7, what=" (0: greedy)"
            ),
            top_p=check_float(f + "top_p", self.top_p, minimum=0, open_min=True, maximum=1),
            top_k=max(top_k or 0, 0),
            min_p=check_float(f + "min_p", self.min_p, minimum=0, maximum=1, example=0.05),
            max_tokens=check_int(
                f + "max_tokens", self.max_tokens, minimum=1, example=16, optional=True
            ),
            stop=_stop_strings(self.stop),
            stop_token_ids=_stop_ids(self.stop_token_ids),
            seed=check_int(f + "seed", self.seed, minimum=0, maximum=2**64 - 1, optional=True),
            ignore_eos=check_bool(f + "ignore_eos", self.ignore_eos),
            n=check_int(f + "n", self.n, minimum=1, maximum=MAX_N, example=1),
            min_tokens=check_int(f + "min_tokens", self.min_tokens, minimum=0),
            logprobs=check_int(f + "logprobs", self.logprobs, minimum=0, example=5, optional=True),
            repetition_penalty=check_float(
                f + "repetition_penalty",
                self.repetition_penalty,
                minimum=0,
                open_min=True,
                example=1.1,
                what=" (1: off)",
            ),
            presence_penalty=check_float(
                f + "presence_penalty", self.presence_penalty, minimum=-2, maximum=2
            ),
            frequency_penalty=check_float(
                f + "frequency_penalty", self.frequency_penalty, minimum=-2, maximum=2
            ),
            include_stop_str_in_output=check_bool(
                f + "include_stop_str_in_output", self.include_stop_str_in_output
            ),
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(f + "min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            _fail(f + "structured_outputs", so, "a StructuredOutputsParams or None",
                  example="StructuredOutputsParams(json_object=True)", type_error=True)  # fmt: skip
        if so is not None and self.ignore_eos:
            _fail(f + "ignore_eos", True, "False with structured_outputs (a finished "
                  "structure ends at the end-of-sequence token)")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any of the repetition, presence or frequency penalties is on."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    field = "SamplingParams.stop"
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, bytes | Mapping) or not isinstance(stop, Sequence | Set):
        _fail(field, stop, "a string or a list of strings", type_error=True)
    out = tuple(stop)
    if len(out) > MAX_STOP_STRINGS:
        _fail(field, stop, f"at most {MAX_STOP_STRINGS} strings (it holds {len(out)})")
    for s in out:
        if not isinstance(s, str):
            _fail(
                field, stop, "a string or a list of strings (stop tokens by id go in "
                f"stop_token_ids); it holds {s!r}, a {type(s).__name__}", type_error=True,
            )  # fmt: skip
        if not s:
            _fail(field, stop, "non-empty strings (an empty one would match at once)")
        if len(s) > MAX_STOP_CHARS:
            _fail(field, s, f"strings of at most {MAX_STOP_CHARS} characters")
    return out


def _stop_ids(ids: Any) -> tuple[int, ...]:
    field = "SamplingParams.stop_token_ids"
    if ids is None:
        return ()
    if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Sequence | Set):
        _fail(field, ids, "a list of token ids (non-negative integers)", type_error=True)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        _fail(field, ids, f"at most {MAX_STOP_TOKEN_IDS} token ids (it holds {len(ids)})")
    out = []
    for t in ids:
        if not is_integer(t):
            _fail(field, ids, f"a list of integers; it holds {t!r}", type_error=True)
        out.append(check_int(field, t, minimum=0))
    return tuple(out)
