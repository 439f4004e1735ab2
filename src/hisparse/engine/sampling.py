"""The batched sampler (its parameters: `hisparse.engine.sampling_params`).

The sampler works on one step's logits ``[B, V]``: ``min_tokens`` masking and the penalties
first (on the device, only on the rows that ask for them), then one batched argmax for the
greedy rows, one batched temperature / top-k / top-p / softmax for the sampled rows and one
inverse-CDF draw for them on the device, from one uniform per row that the host draws from the
request's own generator (``seed``) or torch's global one. The tokens stay on the device
(`sample_on_device`) until the caller reads them: once per step (`sample_rows`), or a step
later where the next decode reads them there (async scheduling). Logprobs, when asked for, add
three small reads for all the rows that want them together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from hisparse.attention.dispatch import env_backend
from hisparse.engine.host_copy import to_device
from hisparse.engine.request import Logprob
from hisparse.engine.sampling_params import SamplingParams as SamplingParams  # re-exported

# -- the sampler -------------------------------------------------------------------------------


class PenaltyState:
    """One request's token counts on the device (the penalties' input): output tokens by
    id, and (for the repetition penalty) which ids its prompt holds. Made on the first step
    that needs it and brought up to date with the new output tokens each step."""

    def __init__(self, prompt: Sequence[int], vocab: int, device: torch.device, rep: bool):
        self.device = device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.prompt_mask: torch.Tensor | None = None
        if rep:
            self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = to_device([t for t in prompt if 0 <= t < vocab], torch.long, device)
            self.prompt_mask[ids] = True
        self.counted = 0


@dataclass
class Sampled:
    """One step's sampling: a token per row (``None``: that row's logits give no
    distribution, so only its request fails) and, for rows that asked, the logprobs dict."""

    tokens: list[int | None]
    logprobs: list[dict[int, float] | None]


@dataclass
class _Row:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    sampler_state: PenaltyState | None = None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | None]:
    """One token per row of ``logits [B, V]`` for rows without history (no penalties
    apply to an empty output); see `sample_rows`."""
    rows = [_Row(p, g) for p, g in zip(params, generators, strict=True)]
    return sample_rows(logits, rows).tokens


def sample_rows(
    logits: torch.Tensor, rows: Sequence[Any], eos_token_ids: Set[int] = frozenset()
) -> Sampled:
    """Sample one token for each row of ``logits [B, V]`` (computed in fp32).

    ``rows[i]`` has ``params``, ``generator``, ``prompt_token_ids``, ``output_token_ids``
    and ``sampler_state`` (a `Request`; the state is kept there between steps).

    A greedy row without penalties or ``min_tokens`` masking is the argmax of its logits,
    bit for bit as before penalties existed. Sampled rows are shifted by their maximum
    before the temperature divides them: any temperature > 0 stays finite (a tiny one
    approaches greedy)."""
    if not rows:
        return Sampled([], [])
    on_device, raw = sample_on_device(logits, rows, eos_token_ids)
    params = [r.params for r in rows]
    lp = logprob_rows(raw, params, on_device)
    tokens: list[int | None] = [t if t >= 0 else None for t in on_device.tolist()]
    return Sampled(tokens, [None] * len(rows) if lp is None else lp.dicts(params, tokens))


def sample_on_device(
    logits: torch.Tensor,
    rows: Sequence[Any],
    eos_token_ids: Set[int] = frozenset(),
    pending: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows`'s tokens left on the device, ``[B]`` int64 (``-1``: a sampled row whose
    logits give no distribution), and the logits as given (`logprob_rows` reads them in fp32;
    the greedy rows' argmax too, without a copy). Nothing here waits for the device:
    the host values it copies (a row's uniform, temperature, ...) go through pinned memory.
    ``pending [B]`` (async scheduling): each row's token still on the device, sampled a step
    before and not yet in its request's output tokens; the penalties count it and
    ``min_tokens`` counts it as generated, as the synchronous engine would once it is read."""
    params = [r.params for r in rows]
    B = len(rows)
    x = process_logits(logits, rows, eos_token_ids, pending)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return greedy_tokens(x), logits
    dev = x.device
    where = None if len(drawn) == B else to_device(drawn, torch.long, dev)
    probs = _probabilities((x if where is None else x.index_select(0, where)).float(),
                           [params[i] for i in drawn])  # fmt: skip
    draws = [float(torch.rand((), generator=rows[i].generator)) for i in drawn]
    uniform = to_device(draws, torch.float32, dev)
    picked = _inverse_cdf(probs, uniform)
    if where is None:
        return picked, logits
    return greedy_tokens(x).index_copy(0, where, picked), logits


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs [R, V]`` (unnormalized, >= 0) the first token whose cumulative
    probability exceeds ``uniform [R]`` (in ``[0, 1)``) times the row's total: a draw from
    the row's distribution; ``-1`` for a row with a non-finite value or nothing to draw.

    A parallel prefix sum (CUDA's) does not add strictly left to right, so a zero-probability
    token's interval may come out a few ulps wide instead of empty: the sum runs in fp64
    (ulps of 1e-16), and a pick that still lands on a zero-probability token (top-k / top-p
    excluded it) takes the row's most likely token instead, so an excluded token is never
    drawn."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[:, -1]
    picked = torch.searchsorted(cdf, (uniform.double() * total)[:, None], right=True)
    picked = picked.clamp_max(probs.shape[-1] - 1)
    zero = probs.gather(1, picked)[:, 0] <= 0
    picked = torch.where(zero, probs.argmax(dim=-1), picked[:, 0])
    ok = torch.isfinite(probs).all(dim=-1) & (total > 0)
    return torch.where(ok, picked, -1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits [B, V]`` in fp32, on their device (``[B]``
    int64): a greedy row's token without penalties or masking, read or not. On CUDA one or
    two Triton launches (`sampling_triton.argmax_rows`, the same index; ``HISPARSE_FUSED``
    picks), elsewhere torch's."""
    if logits.ndim == 2 and env_backend("HISPARSE_FUSED", logits.device) == "triton":
        from hisparse.engine.sampling_triton import argmax_rows

        return argmax_rows(logits)
    return torch.argmax(logits.float(), dim=-1)


def process_logits(
    raw: torch.Tensor,
    rows: Sequence[Any],
    eos_token_ids: Set[int] = frozenset(),
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """``raw [B, V]`` logits after ``min_tokens`` masking, the penalties and the structured
    outputs' grammar masks: ``raw`` itself when no row asks for any, else an fp32 copy changed
    only in the rows that do (``pending``: see `sample_on_device`)."""
    params = [r.params for r in rows]
    dev, V = raw.device, raw.shape[-1]
    pen = [i for i, p in enumerate(params) if p.penalized]
    in_flight = 0 if pending is None else 1
    masked_rows: list[int] = []
    masked_ids: list[int] = []
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        if p.min_tokens and len(r.output_token_ids) + in_flight < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = sorted(t for t in ids if 0 <= t < V)
            masked_rows += [i] * len(ids)
            masked_ids += ids
    grammar_rows = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
    if not pen and not masked_rows and not grammar_rows:
        return raw
    x = raw.to(torch.float32, copy=True)
    if pen:
        _apply_penalties(x, [rows[i] for i in pen], pen, pending)
    if masked_rows:
        where = to_device([masked_rows, masked_ids], torch.long, dev)
        x[where[0], where[1]] = float("-inf")
    if grammar_rows:  # structured outputs: never with a token pending (async steps aside)
        from hisparse.engine.grammar import apply_grammar_masks

        apply_grammar_masks(x, grammar_rows, [rows[i].grammar for i in grammar_rows])
    return x


def _probabilities(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k, softmax and top-p (vLLM's order), batched over the
    sampled rows ``x``."""
    dev, V = x.device, x.shape[-1]
    temps = to_device([p.temperature for p in params], torch.float32, dev)
    x = (x - x.max(dim=-1, keepdim=True).values) / temps[:, None]
    if any(p.min_p > 0 for p in params):
        # p_i >= min_p * p_max  <=>  x_i >= log(min_p), the row's largest x being 0
        floor = to_device([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params],
                          torch.float32, dev)[:, None]  # fmt: skip
        x = torch.where(x < floor, float("-inf"), x)
    ks = [min(p.top_k, V) for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        k_t = to_device(ks, torch.long, dev)
        kth = top.gather(1, (k_t - 1).clamp_min(0)[:, None])
        kth = torch.where(k_t[:, None] > 0, kth, float("-inf"))
        x = torch.where(x < kth, float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], torch.float32, dev)[:, None]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p > top_p) & (top_p < 1)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0))
    return probs


def _apply_penalties(
    x: torch.Tensor, rows: list[Any], index: list[int], pending: torch.Tensor | None = None
) -> None:
    """vLLM's repetition (prompt + output), frequency and presence (output) penalties on
    rows ``index`` of ``x``, in place; one host-to-device copy of the new output tokens.
    ``pending [B]`` (rows of ``x``): each row's token on the device that its output tokens do
    not hold yet (async scheduling), counted here on the device; ``PenaltyState.counted`` then
    runs one ahead of the output tokens, which the token's recording catches up."""
    dev, V = x.device, x.shape[-1]
    states = []
    for r in rows:
        st = r.sampler_state
        if st is None or st.device != dev or st.counts.shape[0] != V:
            rep = r.params.repetition_penalty != 1
            st = r.sampler_state = PenaltyState(r.prompt_token_ids, V, dev, rep)
        states.append(st)
    new = [list(r.output_token_ids[st.counted :]) for r, st in zip(rows, states, strict=True)]
    flat = [t for ts in new for t in ts]
    if flat:
        ids = to_device(flat, torch.long, dev)
        at = 0
        for st, ts in zip(states, new, strict=True):
            if ts:
                st.counts.index_add_(0, ids[at : at + len(ts)], torch.ones(len(ts), device=dev))
                at += len(ts)
    for r, st in zip(rows, states, strict=True):
        st.counted = max(st.counted, len(r.output_token_ids))
    if pending is not None:
        one = torch.ones(1, device=dev)
        for j, st in enumerate(states):
            if st.counted == len(rows[j].output_token_ids):  # not counted yet (one a step)
                i = index[j]
                st.counts.index_add_(0, pending[i : i + 1].clamp(0, V - 1), one)
                st.counted += 1
    counts = torch.stack([st.counts for st in states])
    p = [r.params for r in rows]
    sub = x[index]
    if any(q.repetition_penalty != 1 for q in p):
        rep = to_device([q.repetition_penalty for q in p], torch.float32, dev)[:, None]
        no_prompt = torch.zeros(V, dtype=torch.bool, device=dev)
        seen = torch.stack([no_prompt if s.prompt_mask is None else s.prompt_mask for s in states])
        seen = seen | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    coef = to_device(
        [[q.frequency_penalty for q in p], [q.presence_penalty for q in p]], torch.float32, dev
    )
    sub = sub - coef[0][:, None] * counts - coef[1][:, None] * (counts > 0).float()
    x[index] = sub


@dataclass
class LogprobRows:
    """The logprobs of the rows that asked for them, still tensors: ``rows`` (their indices
    in the step), each row's ``chosen`` token logprob and its ``k`` most likely tokens
    (``top_values`` / ``top_ids``). Computed on the logits' device; `to_host` starts the copy
    to pinned memory (async scheduling reads it a step later), `dicts` builds the output."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    #: the sampled token's rank in its row (1: the most likely)
    chosen_rank: torch.Tensor

    def to_host(self) -> LogprobRows:
        """The same values in host memory, the copies queued on the current stream (pinned
        where on CUDA: read them only after the stream has passed this point)."""

        def host(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return LogprobRows(
            self.rows, host(self.chosen), host(self.top_values), host(self.top_ids),
            host(self.chosen_rank),
        )  # fmt: skip

    def dicts(
        self, params: list[SamplingParams], tokens: list[int | None]
    ) -> list[dict[int, Logprob] | None]:
        """``{token: Logprob}`` per row (each with its rank): the sampled token's first, then
        up to ``logprobs`` most likely ones; ``None`` for rows that did not ask or took no
        token."""
        out: list[dict[int, Logprob] | None] = [None] * len(params)
        chosen, ranks = self.chosen.tolist(), self.chosen_rank.tolist()
        top_v, top_i = self.top_values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            token = tokens[i]
            if token is None:
                continue
            d = {int(token): Logprob(float(chosen[j]), int(ranks[j]))}
            for r, (t, v) in enumerate(zip(top_i[j][: params[i].logprobs], top_v[j],
                                           strict=False)):  # fmt: skip
                d.setdefault(int(t), Logprob(float(v), r + 1))
            out[i] = d
        return out


def logprob_rows(
    raw: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
) -> LogprobRows | None:
    """The logprobs of the rows of ``raw [B, V]`` (logits, in fp32, before any processing:
    vLLM's ``raw_logprobs``) that ask for them, for the device tokens ``tokens [B]`` (``-1``
    rows give a value `LogprobRows.dicts` drops); ``None`` when no row asks. Nothing here
    waits for the device."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return None
    dev, V = raw.device, raw.shape[-1]
    index = None if len(want) == len(params) else to_device(want, torch.long, dev)
    lp = torch.log_softmax((raw if index is None else raw.index_select(0, index)).float(), dim=-1)
    picked = (tokens if index is None else tokens.index_select(0, index)).clamp_min(0)
    chosen = lp.gather(1, picked[:, None].long())[:, 0]
    k = min(max(params[i].logprobs or 0 for i in want), V)
    top_v, top_i = _top_logprobs(lp, k) if k else (lp[:, :0], lp[:, :0].long())
    rank = (lp > chosen[:, None]).sum(dim=-1) + 1
    return LogprobRows(want, chosen, top_v, top_i, rank)


def _top_logprobs(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``lp [W, V]``, best first, equal values in ascending
    id order: the same per row whatever ``k`` (the batch's largest request) and the other
    rows, which ``torch.topk``'s tie order is not. Linear in ``V`` and no host sync (on the
    CPU slower than a plain ``topk``, faster than a full sort)."""
    V = lp.shape[-1]
    kth = torch.topk(lp, k, dim=-1).values[:, k - 1 :]  # the k-th value: exact either way
    above = lp > kth
    tied = lp == kth
    # of the values equal to the k-th, the lowest ids, as many as the row still needs
    room = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied.int(), dim=-1) <= room))
    ids = torch.arange(V, device=lp.device)
    kept = torch.topk(torch.where(keep, V - ids, -1), k, dim=-1).indices  # ascending ids
    values = lp.gather(1, kept)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), kept.gather(1, order)
