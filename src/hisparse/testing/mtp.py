"""MTP speculative decoding's test tools (CPU and GPU tests): the drafts an engine's MTP
layer made, recorded (and optionally replaced), and the same drafts computed densely.

The dense reference runs the main model and the MTP layer over every position of a
sequence in one step each (`DenseDsaCache` with one more layer for the MTP layer's rows and
indexer keys), then the MTP layer alone for the further drafts: what the engine computes in
pieces across prefill chunks, verifying steps and rewrites.
"""

from __future__ import annotations

from typing import Any

import torch


def watch_drafts(
    llm: Any,
    seen: list[tuple[list[int], list[int]]] | None,
    accept: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> None:
    """Record in ``seen`` each request's (tokens up to the step's input, MTP drafts) as the
    engine ``llm`` makes them; with ``accept`` (each prompt's plain output, ``prompts`` in
    the same order) replace them by that continuation after the MTP layer ran (all taken)."""
    drafter = llm.runner.mtp
    made = drafter.draft

    def draft(batch: Any, drafts: list[list[int]] | None) -> None:
        made(batch, drafts)
        for i, (req, _) in enumerate(batch):
            if not drafts or not drafts[i]:
                continue
            c = req.num_computed
            if seen is not None:
                seen.append((req.token_slice(0, c + 1), list(drafts[i])))
            if accept is not None and prompts is not None:
                j = prompts.index(req.prompt_token_ids)
                full = prompts[j] + accept[j]
                drafts[i][:] = full[c + 1 : c + 1 + len(drafts[i])]

    drafter.draft = draft


@torch.no_grad()
def reference_drafts(
    model: Any, tokens: list[int], k: int, row_format: str = "bf16"
) -> tuple[list[int], list[torch.Tensor]]:
    """The ``k`` MTP drafts after ``tokens`` (its last one the step's input) computed
    densely, and each draft's logits."""
    mtp, c = model.mtp[0], len(tokens) - 1
    cache = model.new_dense_cache(max_reqs=1, max_len=c + k, block_size=4, row_format=row_format)
    cache.kv.append(torch.zeros_like(cache.kv[0]))  # the MTP layer's rows and keys
    cache.index_pages[mtp.self_attn.layer] = torch.zeros_like(cache.index_pages[0])
    ids = torch.tensor(tokens, device=cache.device)
    step = cache.begin_step([0], [c])
    h = model(ids[:c], step, cache)
    g = mtp(model, h, ids[1:], step, cache)[-1:]
    out: list[int] = []
    rows: list[torch.Tensor] = []
    for i in range(k):
        normed, logits = mtp.head(model, g)
        out.append(int(logits.argmax(-1)))
        rows.append(logits[0])
        if i + 1 < k:
            step = cache.begin_step([0], [1])
            g = mtp(model, normed, ids.new_tensor(out[-1:]), step, cache)
    return out, rows


def check_drafts(
    model: Any, seen: list[tuple[list[int], list[int]]], tie: float = 0.0
) -> list[float]:
    """Every recorded draft equals the dense reference's; with ``tie`` > 0 a differing draft
    passes where it sits at a near-tie of the reference's logits (the engine's draft within
    ``tie`` of the best logit, from the first differing draft on, since later drafts follow
    it). Returns the margins of the differences allowed (for the log)."""
    assert seen, "no MTP draft was made"
    margins = []
    for tokens, drafts in seen:
        want, logits = reference_drafts(model, tokens, len(drafts))
        if want == drafts:
            continue
        i = next(j for j, (a, b) in enumerate(zip(want, drafts, strict=True)) if a != b)
        margin = float(logits[i].max() - logits[i][drafts[i]])
        assert margin <= tie, (len(tokens), i, want, drafts, margin)
        margins.append(margin)
    return margins
