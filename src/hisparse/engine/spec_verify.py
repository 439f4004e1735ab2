"""Verification of a speculative decode step: which drafts each request takes.

A request's rows are its last token then its drafts ``d1..dk``; row j's logits give the
distribution of the token after ``d1..dj``. Row by row, the request's own sampler
(`sampling.sample_rows`: its penalties counting ``d1..dj`` as output, ``min_tokens``, its
random stream) picks the token the non-speculative engine would pick there; the draft is
taken when it equals that pick, else the pick ends the step (with all drafts taken, the last
row's pick is the extra token). A draft of the proposers here is one token, not a
distribution: taking it exactly when an independent draw from ``p`` equals it is rejection
sampling with a point-mass draft (accepted with probability ``p(d)``, and on rejection a draw
from ``p`` with ``d`` removed, renormalized), so sampled requests keep their output
distribution, greedy ones their tokens, and a seeded request draws what it would draw without
speculation (one uniform per token, in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from hisparse.engine.request import Request
from hisparse.engine.sampling import greedy_tokens, sample_rows


@dataclass
class Verified:
    """Per request (in batch order): the drafts it took, then its next token (``None``: its
    logits gave no distribution) and their logprobs dicts where asked."""

    accepted: list[list[int]]
    tokens: list[int | None]
    accepted_logprobs: list[list[dict[int, float] | None]]
    logprobs: list[dict[int, float] | None]


class _DraftRow:
    """A request seen by the sampler as if drafts ``taken`` were already its output."""

    def __init__(self, req: Request, taken: Sequence[int]) -> None:
        self.req = req
        self.params, self.generator = req.params, req.generator
        # a structured output drafts nothing (`Scheduler._drafts`): its one row is depth 0,
        # where the grammar's state is the request's own
        self.grammar = req.grammar if not taken else None
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = (
            req.output_token_ids + list(taken) if taken else req.output_token_ids
        )

    @property
    def sampler_state(self) -> Any:
        return self.req.sampler_state

    @sampler_state.setter
    def sampler_state(self, value: Any) -> None:
        self.req.sampler_state = value


def _plain_greedy(req: Request) -> bool:
    p = req.params
    plain = p.greedy and not p.penalized and not p.min_tokens and p.logprobs is None
    return plain and req.grammar is None


def verify(
    logits: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    eos_token_ids: Set[int] = frozenset(),
) -> Verified:
    """Take drafts row by row (module docstring). ``logits [T, V]``: each request's
    ``1 + len(drafts[i])`` rows, requests in order."""
    n = len(reqs)
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += 1 + len(d)
    if at != logits.shape[0]:
        raise ValueError(f"verify: {logits.shape[0]} rows of logits for {at} rows of drafts")
    out = Verified([[] for _ in range(n)], [None] * n, [[] for _ in range(n)], [None] * n)
    if all(_plain_greedy(r) for r in reqs):
        # every row's pick is its argmax: one read for the whole step
        picks = greedy_tokens(logits).tolist()
        for i, d in enumerate(drafts):
            row = picks[starts[i] : starts[i] + 1 + len(d)]
            j = 0
            while j < len(d) and row[j] == d[j]:
                j += 1
            out.accepted[i] = d[:j]
            out.accepted_logprobs[i] = [None] * j
            out.tokens[i] = row[j]
        return out
    going = list(range(n))
    depth = 0
    while going:
        rows = torch.tensor([starts[i] + depth for i in going], device=logits.device)
        views = [_DraftRow(reqs[i], drafts[i][:depth]) for i in going]
        sampled = sample_rows(logits.index_select(0, rows), views, eos_token_ids)
        still = []
        for i, tok, lp in zip(going, sampled.tokens, sampled.logprobs, strict=True):
            d = drafts[i]
            if tok is not None and depth < len(d) and tok == d[depth]:
                out.accepted[i].append(tok)
                out.accepted_logprobs[i].append(lp)
                still.append(i)
            else:
                out.tokens[i], out.logprobs[i] = tok, lp
        going = still
        depth += 1
    return out
