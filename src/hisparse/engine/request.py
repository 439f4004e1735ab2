"""A request's life in the engine: tokens, status, metrics, and what `generate` returns
(vLLM's shape: a `RequestOutput` per prompt holding a `CompletionOutput` per completion)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hisparse.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from hisparse.engine.sampling import PenaltyState


class Logprob(float):
    """One token's log-probability as vLLM's ``Logprob`` reads it (``.logprob``, ``.rank``:
    1 for the most likely token, ``.decoded_token``), and still the float itself, so code
    that adds, compares or serializes logprobs as numbers works unchanged."""

    __slots__ = ("decoded_token", "rank")

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (tensor-parallel ranks) keep the fields
        return (Logprob, (float(self), self.rank, self.decoded_token))


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    #: output tokens the request held when it was first preempted (None: never preempted)
    tokens_before_first_preemption: int | None = None
    hits: int = 0
    misses: int = 0
    #: KV bytes copied host -> GPU for this request's misses (row bytes x misses, all layers)
    bytes_swapped: int = 0
    #: decode steps this request took part in
    decode_steps: int = 0
    #: prompt tokens found in the prefix cache at its first admission (not prefilled)
    cached_tokens: int = 0
    #: speculative decoding: draft tokens verified, those accepted, and the steps that
    #: verified any (the mean accepted length is ``1 + spec_accepted / spec_steps``)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts accepted of those verified (None: nothing was drafted)."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying step gave on average: its accepted drafts and one more."""
        return 1 + self.spec_accepted / self.spec_steps if self.spec_steps else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)


@dataclass(eq=False)  # a request is itself: the scheduler's lists compare by identity
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    #: tokens whose KV is computed (prompt prefix, then generated tokens)
    num_computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    #: which of the prompt's ``n`` completions this is
    index: int = 0
    #: per output token ``{token_id: Logprob}`` (``params.logprobs`` set), else None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    #: the stop string or stop token id that ended the request (None: EOS, length, error)
    stop_reason: str | int | None = None
    #: the penalties' device state (`hisparse.engine.sampling.PenaltyState`)
    sampler_state: PenaltyState | None = None
    #: the structured output's matcher (an xgrammar ``GrammarMatcher``, `engine.grammar`)
    #: that follows this request's tokens; ``None``: free text
    grammar: Any = None
    #: incremental decoding state (`hisparse.engine.output_processor.DetokenizerState`)
    detokenizer: object | None = None
    #: the prefix cache's hashes of its first full pages (`PrefixCache.hashes`)
    page_hashes: list[bytes] = field(default_factory=list, repr=False)
    #: the seed of this request's random stream (None: greedy, no stream)
    sampling_seed: int | None = field(default=None, init=False)
    _generator: Any = field(default=None, init=False, repr=False)
    #: speculative decoding: decode steps to run without drafts after drafts were all
    #: refused, and the next such pause (doubling while they keep being refused)
    draft_pause: int = field(default=0, init=False, repr=False)
    draft_backoff: int = field(default=1, init=False, repr=False)
    #: MTP drafts: the main model's hidden state at the last computed row (`mtp_drafts`)
    mtp_hidden: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.sampling_seed = completion_seed(self.params.seed, self.index)
        elif not self.params.greedy:
            # a stream of its own, seeded from torch's global generator (`torch.manual_seed`
            # makes a run reproducible): its draws do not depend on what runs beside it, nor
            # on an extra step computed for another request (async scheduling)
            import torch

            self.sampling_seed = int(torch.randint(0, 2**63 - 1, ()).item())
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    @property
    def generator(self) -> torch.Generator | None:
        """The request's own random stream, made on the first draw (the scheduler handles
        requests without torch)."""
        if self._generator is None and self.sampling_seed is not None:
            import torch

            self._generator = torch.Generator().manual_seed(self.sampling_seed)
        return self._generator

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens ``[start, start + n)`` of prompt + output, without copying the whole
        sequence (at 128K tokens `all_token_ids` per step would dominate the host time)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        if start + n <= p:
            return self.prompt_token_ids[start : start + n]
        # (a simulated prompt may be a range: no list of its ids is ever built)
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: start + n - p]]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most new tokens (unbounded without ``max_tokens``: the
        engine's ``max_model_len`` caps it)."""
        most = self.params.max_tokens
        return len(self.prompt_token_ids) + (most if most is not None else 1 << 62)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded ``seed``: ``seed`` itself for the
    first (``n=1`` draws what it always drew), a 64-bit mix of both for the others."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's ``CompletionOutput``; ``error`` and ``metrics``
    are hisparse's additions)."""

    index: int
    text: str
    token_ids: list[int]
    #: ``"stop"`` (EOS, a stop string or stop token), ``"length"``, ``"error"``, ``"abort"``
    finish_reason: str | None
    #: per token ``{token_id: Logprob}`` when ``SamplingParams.logprobs`` was set (vLLM's
    #: shape: ``.logprob``, ``.rank``, ``.decoded_token``; each is also the float)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    #: why this completion failed (``finish_reason == "error"``)
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @classmethod
    def of(cls, req: Request, tokenizer: Any = None) -> CompletionOutput:
        """``req``'s completion; with a ``tokenizer`` each logprob gets its
        ``decoded_token``."""
        lps = req.logprobs
        if lps is not None and tokenizer is not None:
            lps = [
                {t: Logprob(v, getattr(v, "rank", None), tokenizer.decode([t]))
                 for t, v in lp.items()}
                for lp in lps
            ]  # fmt: skip
        return cls(
            index=req.index,
            text=req.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            logprobs=lps,
            cumulative_logprob=req.cumulative_logprob,
            stop_reason=req.stop_reason,
            error=req.error,
            metrics=req.metrics,
        )


@dataclass
class RequestOutput:
    """What `LLM.generate` returns for one prompt (in input order), shaped like vLLM's.

    ``text``, ``token_ids`` and ``finish_reason`` read the first completion (the usual
    ``n=1`` case); ``error`` is the first error among the completions, ``ok`` that there is
    none. ``metrics`` are the first completion's (each has its own in
    ``outputs[i].metrics``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return next((o.error for o in self.outputs if o.error is not None), None)

    @property
    def ok(self) -> bool:
        return self.error is None
