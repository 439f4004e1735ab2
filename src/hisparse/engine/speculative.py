"""Speculative decoding's settings and its draft proposers (no torch: the scheduler asks for
drafts while it builds a step).

`SpeculativeConfig` is vLLM's ``speculative_config`` shape: ``method`` (``"ngram"``: prompt
lookup; ``"mtp"``: the checkpoint's multi-token-prediction layer, `engine.mtp_drafts`) and
``num_speculative_tokens`` k. A decode step then brings up to k + 1 rows per request (its last
token and its drafts); the runner verifies them in one forward (`hisparse.engine.spec_verify`)
and a request takes the drafts its own sampler agrees with, plus one token more.

The n-gram proposer follows vLLM's prompt lookup: the longest suffix of the request's tokens
(prompt and output) of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens that occurred
earlier, its most recent occurrence, and the k tokens that followed it there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.validation import _fail, check_choice, check_int

#: ``ngram``: prompt lookup over the request's own tokens; ``mtp``: the checkpoint's MTP layer
SPECULATIVE_METHODS = ("ngram", "mtp")
#: Most draft tokens a step may bring per request (the hot buffer holds (k + 1) * top_k rows).
MAX_SPECULATIVE_TOKENS = 16
#: The CLI's ``--speculative-config`` (generate, bench, serve).
SPECULATIVE_HELP = (
    'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
    "(fields: method: ngram, prompt lookup, or mtp, the checkpoint's multi-token-prediction "
    "layer; num_speculative_tokens; prompt_lookup_min, prompt_lookup_max for ngram)"
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``).

    Attributes:
        method: ``"ngram"`` (prompt lookup, any model) or ``"mtp"`` (the checkpoint's MTP
            layer: DeepSeek-V3.2 / GLM-5 checkpoints with ``num_nextn_predict_layers``).
        num_speculative_tokens: draft tokens per request and step (k); a step verifies up to
            k + 1 rows per request, so ``HiSparseConfig.max_query_len`` becomes k + 1.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths matched (vLLM's: both 5
            when neither is given, else the one given for both).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        f = "SpeculativeConfig."
        check_choice(f + "method", self.method, SPECULATIVE_METHODS)
        check_int(f + "num_speculative_tokens", self.num_speculative_tokens, minimum=1,
                  maximum=MAX_SPECULATIVE_TOKENS, example=4)  # fmt: skip
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            check_int(f + name, getattr(self, name), minimum=1, example=3, optional=True)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:  # type: ignore[operator]
            _fail(f + "prompt_lookup_min", lo, f"at most prompt_lookup_max={hi}", example=hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A config from ``value``: ``None``, a `SpeculativeConfig`, a dict of its fields or
        that dict as JSON text (the CLI's ``--speculative-config``)."""
        if value is None or isinstance(value, cls):
            return value
        where = "speculative_config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}={value!r} is not JSON: {err}; pass e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, Mapping):
            _fail(where, value, "a SpeculativeConfig, a dict of its fields or None",
                  type_error=True)  # fmt: skip
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(known)}")
        return cls(**value)

    @classmethod
    def for_engine(cls, llm_kwargs: Mapping[str, Any]) -> SpeculativeConfig | None:
        """`LLM`'s ``speculative_config`` (in its keyword arguments ``llm_kwargs``) read and
        checked against the rest: one rank only (a speculative step samples on the driver
        and its accepted counts would have to travel to every rank: not built)."""
        spec = cls.of(llm_kwargs.get("speculative_config"))
        ranks = max(llm_kwargs.get("tensor_parallel_size", 1),
                    llm_kwargs.get("data_parallel_size", 1))  # fmt: skip
        if spec is not None and ranks > 1:
            _fail("LLM.speculative_config", llm_kwargs["speculative_config"], "None with "
                  "tensor or data parallelism (speculative decoding runs on one rank)")  # fmt: skip
        return spec

    @staticmethod
    def widen(spec: SpeculativeConfig | None, hisparse: HiSparseConfig) -> HiSparseConfig:
        """``hisparse`` with room for ``spec``'s rows: ``max_query_len`` at least k + 1 (the
        hot buffer's default and the runtime's row buffers follow it)."""
        if spec is None or hisparse.max_query_len >= spec.max_query_len:
            return hisparse
        return dataclasses.replace(hisparse, max_query_len=spec.max_query_len)

    @staticmethod
    def mtp_layers(spec: SpeculativeConfig | None, model: Any) -> int:
        """MTP layers the engine runs for ``spec`` (0 or 1: their KV is part of the layout);
        a `HiSparseConfigError` for ``method="mtp"`` on a model without one
        (``num_nextn_predict_layers`` 0, a GGUF model) or whose MTP layer has no indexer."""
        if spec is None or spec.method != "mtp":
            return 0
        layers = getattr(model, "mtp", None)
        where = dict(field="LLM.speculative_config", value=spec)
        if not layers:
            n = getattr(getattr(model, "config", None), "num_nextn_predict_layers", 0)
            raise HiSparseConfigError(
                "LLM.speculative_config method='mtp' drafts with the checkpoint's "
                "multi-token-prediction layer, and this model has none "
                f"(num_nextn_predict_layers = {n or 0}, no MTP layer weights; DeepSeek-V3.2 "
                "and GLM-5 releases ship one); use method='ngram'.",
                **where,
            )
        if layers[0].self_attn.indexer is None:
            raise HiSparseConfigError(
                "the checkpoint's MTP layer has no indexer of its own (no top-k to borrow): "
                "use method='ngram'.",
                **where,
            )
        return 1

    @property
    def max_query_len(self) -> int:
        """Rows one request brings to a decode step: its last token and k drafts."""
        return self.num_speculative_tokens + 1

    def proposer(self) -> NgramProposer | MtpProposer:
        if self.method == "mtp":
            return MtpProposer()
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)  # type: ignore[arg-type]


#: A draft the runner fills in (`engine.mtp_drafts`); never a token, so never accepted.
MTP_DRAFT = -1


class MtpProposer:
    """The scheduler's side of MTP drafts: k placeholders, which the runner's `MtpDrafter`
    fills at the start of the step (the drafts need the model); the prefix cache registers
    pages one row short of the computed length (``rewrites``), since the MTP row at the last
    computed position is rewritten by the next step. Refused MTP drafts pause nothing
    (``pauses``, `scheduler.pause_drafts`, is the n-gram lookup's): the model's own drafts are
    taken most of the time on the releases, and neither vLLM nor SGLang pauses them."""

    rewrites = 1
    pauses = False

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [MTP_DRAFT] * k


class NgramProposer:
    """Prompt-lookup drafts (vLLM's ``ngram`` method) over a request's prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix of ``tokens`` of ``min_n`` to ``max_n`` tokens; ``[]`` where none occurred."""
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:
            return []
        a = np.asarray(tokens, dtype=np.int64)
        # earlier positions e holding the last token: each a candidate end of a match
        ends = np.flatnonzero(a[:-1] == a[-1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)
        live = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, n_tok - 1)):
            at = ends - j
            ok = live & (at >= 0)
            ok[ok] = a[at[ok]] == a[n_tok - 1 - j]
            length += ok
            live = ok
            if not live.any():
                break
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
        return a[end + 1 : end + 1 + k].tolist()
