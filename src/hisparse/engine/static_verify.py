"""Speculative verify steps on the fixed-shape decode path (CUDA graphs on CUDA).

Where the runner's decode steps take the fixed-shape path (`engine.cuda_graphs`), a verify
step does too: a second `DecodeGraphs` with ``rows = max_query_len`` (k + 1) rows per request,
padded batch sizes as the one-row graphs', captured per (padded batch, kind) on first use. Each
request's rows are its last token and its drafts; rows past its drafts are padding (slot
``-1``: nothing written, nothing selected). The step body is `ModelRunner._static_step` with
``rows``: the model sees every row as a one-row decode at its position (so the per-token
kernels of the one-row step serve it unchanged), the runtime resolves each request's rows
against its one hot buffer. The logits of the real rows are gathered back into the packed
order `spec_verify.verify` reads.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from hisparse.engine.cuda_graphs import DecodeGraphs

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner, StepResult
    from hisparse.engine.request import Request


def static_verify_takes(runner: ModelRunner, drafts: list[list[int]]) -> bool:
    """Whether this verify step runs on the fixed-shape path: the runner's decode steps do,
    no step hooks (they replay one selection per request), not DeepSeek-V4 (per-slot
    compressor state), no MTP layer (its engine decodes eagerly), and every request brings
    at most ``max_query_len`` rows."""
    q = runner.config.max_query_len
    return (
        runner.graphs is not None
        and runner.hooks is None
        and runner.v4_state is None
        and runner.mtp is None
        and q > 1
        and all(1 + len(d) <= q for d in drafts)
    )


def run_static_verify(runner: ModelRunner, reqs: list[Request], drafts: list[list[int]]):
    """A verify step through the verify graphs: one copy of the rows, a replayed graph (or
    the same fixed-shape step run eagerly), the real rows' logits in packed order."""
    from hisparse.engine.model_runner import StepResult

    graphs = runner.verify_graphs
    if graphs is None:
        one = runner.graphs
        assert one is not None
        graphs = DecodeGraphs(
            runner.max_num_seqs, runner.device, capture=one.capture,
            rows=runner.config.max_query_len,
        )  # fmt: skip
        runner.verify_graphs = graphs
    kv, q = runner.kv, graphs.rows
    ids = [req.token_slice(req.num_computed, 1) + d for req, d in zip(reqs, drafts, strict=True)]
    slots = [kv.requests[req.req_id].slot for req in reqs]
    keys = [runner.request_key(req) for req in reqs]
    b = graphs.load_rows(ids, [req.num_computed for req in reqs], slots, keys)
    resident = runner._all_resident([req.req_id for req in reqs])
    logits, counts = graphs.run(
        b, partial(runner._static_step, rows=q), all_resident=resident,
        both_kinds=kv.policy.under_pressure,
    )  # fmt: skip
    runner.warm = None
    runner._pending.append((reqs, counts[: len(reqs)].clone()))
    real = [r * q + j for r, toks in enumerate(ids) for j in range(len(toks))]
    index = torch.tensor(real, dtype=torch.long).to(logits.device, non_blocking=True)
    result: StepResult = StepResult(logits=logits.index_select(0, index), sample_reqs=reqs)
    return result
