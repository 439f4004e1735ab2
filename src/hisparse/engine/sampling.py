"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` switch those filters off.
    ``seed`` makes a request's random choices reproducible whatever else runs beside it.
    Generation stops at ``max_tokens`` new tokens, at an end-of-sequence token (unless
    ``ignore_eos``), at one of ``stop_token_ids``, or when the text ends with one of ``stop``
    (the stop string is cut from the returned text).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "top_k", _integer("top_k", self.top_k))
        object.__setattr__(self, "max_tokens", _integer("max_tokens", self.max_tokens))
        if self.seed is not None:
            object.__setattr__(self, "seed", _integer("seed", self.seed))
        ids = tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be in [0, 2**64).")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature={self.temperature} must be finite and >= 0 (0 = greedy)."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty (an empty one matches at once).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _integer(name: str, value: object) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an integer.") from None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | None]:
    """One token per row of ``logits [B, V]`` (computed in fp32); ``None`` for a sampled row
    whose logits give no distribution (not finite), so only that request fails.

    Greedy rows are decided by one batched argmax and one device-to-host copy, so a decode
    step of many requests syncs with the device once, not once per request. Sampled rows are
    shifted by their maximum before the temperature divides them: any temperature > 0 stays
    finite (a tiny one approaches greedy)."""
    out: list[int | None] = [0] * len(params)
    logits = logits.float()
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, tok in zip(greedy, torch.argmax(rows, dim=-1).tolist(), strict=True):
            out[i] = int(tok)
    for i, (row, p, gen) in enumerate(zip(logits, params, generators, strict=True)):
        if p.greedy:
            continue
        x = (row - row.max()) / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, 0)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs.cpu()
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            out[i] = None
            continue
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
