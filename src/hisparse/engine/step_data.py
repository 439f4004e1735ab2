"""The plain data one engine step passes along its seams (vLLM v1's shape): the scheduler's
`SchedulerOutput` (what to run, the block-table changes, the pages to copy to the host), the
runner's `ModelOutput` per forward (the sampled tokens), which `Scheduler.update_from_output`
consumes. No torch here: the scheduler side of the seam runs without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse.engine.kv_blocks import IndexerCopy, TableUpdate, WriteBack
from hisparse.engine.request import Request


@dataclass
class ScheduledStep:
    """One forward: a decode part (one token per request) or a prefill part (prompt chunks)."""

    decode: bool
    batch: list[tuple[Request, int]]
    #: per batch entry: does this step compute the request's last prompt token
    finishing: list[bool]
    #: its tokens were counted as computed and its tail trimmed when it was launched, before
    #: its sampled tokens were read (async scheduling: `Scheduler.launched`)
    launched: bool = False
    #: speculative decoding: per batch entry, the draft tokens its rows verify after the
    #: request's last token (``n = 1 + len(drafts[i])``); ``None``: no drafts this step
    drafts: list[list[int]] | None = None

    @property
    def requests(self) -> list[Request]:
        return [req for req, _ in self.batch]


@dataclass
class SchedulerOutput:
    """One engine step as plain data: its forwards (decode part first), and what the runner
    does before them, in this order: the block-table changes, hot-state resets of newly
    leased slots, the lazy mirror's write-backs and a prefix-cache hit's page fills, and the
    prefix cache's indexer key copies made since the previous output."""

    parts: list[ScheduledStep]
    table_updates: list[TableUpdate] = field(default_factory=list)
    slot_resets: list[int] = field(default_factory=list)
    write_backs: list[WriteBack] = field(default_factory=list)
    indexer_copies: list[IndexerCopy] = field(default_factory=list)


@dataclass
class ModelOutput:
    """What the runner returns for one forward: the sampled token of each request in
    ``sample_reqs`` (``None``: its logits gave no distribution, so it fails alone), the
    logprobs dict where asked, and when the tokens were read (``now``, ``perf_counter``).
    A speculative step (`ScheduledStep.drafts`) also gives, per request, the drafts it took
    (``accepted``: they come before ``tokens[i]``) and their logprobs."""

    sample_reqs: list[Request]
    tokens: list[int | None]
    logprobs: list[dict[int, float] | None]
    now: float
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[dict[int, float] | None]] | None = None
