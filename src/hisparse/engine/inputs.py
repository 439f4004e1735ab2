"""What `LLM.generate` accepts as prompts and parameters, and the outputs it builds.

Prompts are read into ``(text, token ids, error)`` triples before anything runs, so a bad
prompt fails its own output and a bad call fails before any request is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hisparse.engine.request import CompletionOutput, Request, RequestOutput
from hisparse.engine.sampling import SamplingParams
from hisparse.validation import _fail, is_token_list


def outputs_of(groups: list[tuple[str, str | None, list[Request]]]) -> list[RequestOutput]:
    return [
        RequestOutput(
            request_id=rid,
            prompt=text,
            prompt_token_ids=list(reqs[0].prompt_token_ids),
            outputs=[CompletionOutput.of(r) for r in reqs],
            finished=all(r.finished for r in reqs),
            metrics=reqs[0].metrics,
        )
        for rid, text, reqs in groups
    ]


def text_inputs(prompts: Any) -> list[tuple[str | None, Any, str | None]]:
    """(text, token ids, error) per prompt of ``generate(prompts=...)``."""
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        _fail(
            "prompts", prompts, "a string, a list of strings or of {'prompt': ...} / "
            "{'prompt_token_ids': [...]} dicts", type_error=True,
        )  # fmt: skip
    out: list[tuple[str | None, Any, str | None]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None, None))
        elif isinstance(p, Mapping) and isinstance(p.get("prompt"), str):
            out.append((p["prompt"], None, None))
        elif isinstance(p, Mapping) and "prompt_token_ids" in p:
            out.append((None, p["prompt_token_ids"], None))
        else:
            out.append((None, None, (
                f"a prompt must be a string, or a dict with 'prompt' (a string) or "
                f"'prompt_token_ids'; got {type(p).__name__}"
            )))  # fmt: skip
    return out


def token_inputs(prompt_token_ids: Any) -> list[tuple[str | None, Any, str | None]]:
    """(text, token ids, error) per prompt of ``generate(prompt_token_ids=...)``: a flat
    list of ids is one prompt."""
    if is_token_list(prompt_token_ids):
        return [(None, prompt_token_ids, None)]
    if isinstance(prompt_token_ids, torch.Tensor) and prompt_token_ids.dim() == 2:
        return [(None, row, None) for row in prompt_token_ids]
    if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
        _fail(
            "prompt_token_ids", prompt_token_ids,
            "a list of token ids (one prompt) or a list of such lists", type_error=True,
        )  # fmt: skip
    return [(None, ids, None) for ids in prompt_token_ids]


def params_per_prompt(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, str | bytes | Mapping) or not isinstance(params, Sequence):
        _fail(
            "sampling_params", params, "a SamplingParams, a list of them or None",
            type_error=True,
        )  # fmt: skip
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            _fail(f"sampling_params[{i}]", p, "a SamplingParams", type_error=True)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts: give one, or one each")
    return params


def completions(
    rid: str, ids: list[int], params: SamplingParams, prompt: str | None
) -> list[Request]:
    """The ``params.n`` requests of one prompt (ids ``rid``, or ``rid.0`` .. ``rid.{n-1}``)."""
    return [
        Request(
            req_id=rid if params.n == 1 else f"{rid}.{j}",
            prompt_token_ids=ids,
            params=params,
            prompt=prompt,
            index=j,
        )
        for j in range(params.n)
    ]
