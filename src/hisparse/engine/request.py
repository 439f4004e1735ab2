"""A request's life in the engine: tokens, status, metrics, and what `generate` returns."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from hisparse.engine.sampling import SamplingParams


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

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)


@dataclass
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
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

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
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + n - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What `LLM.generate` returns for one prompt (in input order)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    metrics: RequestMetrics

    @property
    def ok(self) -> bool:
        return self.error is None
