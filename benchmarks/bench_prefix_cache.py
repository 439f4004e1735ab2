"""Prefix caching on the CPU with SmolLM2 (docs/design.md §12.10): what a cached prefix saves.

    PYTHONPATH=src python benchmarks/bench_prefix_cache.py [--placement hisparse] [--repeats 3]

Two workloads, each run on an engine with prefix caching and on one without, one after the
other in one process (the same settings otherwise):

1. **Second turn of a conversation over a document.** Turn 1: a chat prompt holding a ~3K-token
   document (Python reference text) and a question, answered with exactly 64 tokens. Turn 2:
   turn 1's prompt, its answer and a 32-token question. Reported: turn 2's TTFT (one token
   generated), with the cache and without, and the ratio (median over ``--repeats`` rounds,
   a fresh engine of each kind per round, in turn, so load from other jobs hits both alike:
   one process holds one host pool), and the prompt tokens turn 2 found cached. The tokens of
   both turns must be the same either way (else exit 1).
2. **``n = 4`` over a 2K-token prompt.** Reported: the prompt tokens prefilled (the prefill
   forwards' tokens, `LLM.last_run_stats`) with the cache and without, and whether the four
   completions agree (seeded sampling).

``--threads`` (default 1) sets torch's CPU threads. JSON to ``$OUT/bench_prefix_cache.json``
(or ``--out``) when set. On a shared CPU compare only
the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from pydoc_data.topics import topics

import torch

from hisparse.config import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

DOC_TOKENS = 3000
ANSWER_TOKENS = 64
QUESTION_TOKENS = 32
N_PROMPT_TOKENS = 2048


def log(msg: str) -> None:
    print(msg, flush=True)


def _engine(caching: bool, placement: str) -> LLM:
    return LLM(
        "smollm2",
        kv_placement=placement,
        hisparse=HiSparseConfig(host_pool_gib=1.0),
        max_model_len=4096,
        max_num_seqs=4,
        gpu_memory_gib=0.5,
        device="cpu",
        enable_prefix_caching=caching,
    )


def _text(llm: LLM, n: int, start: int = 0) -> list[int]:
    body = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return llm.encode(body, add_special_tokens=False)[start : start + n]


def _turns(llm: LLM) -> tuple[list[int], list[int]]:
    """Turn 1's prompt and turn 2's prompt minus the answer (which each engine generates)."""
    doc = llm.tokenizer.decode(_text(llm, DOC_TOKENS))
    first = llm.tokenizer.encode_chat([{"role": "user", "content": doc + "\n\nSummarize it."}])
    question = _text(llm, QUESTION_TOKENS, start=DOC_TOKENS + 500)
    return first, question


def conversation(placement: str, repeats: int) -> dict:
    ttft: dict[bool, list[float]] = {True: [], False: []}
    ratios, cached, tokens = [], 0, {}
    answer = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for r in range(repeats):
        for caching in (True, False):
            with _engine(caching, placement) as llm:  # one host pool per process: in turn
                first, question = _turns(llm)
                out1 = llm.generate(prompt_token_ids=[first], sampling_params=answer)[0]
                second = first + out1.token_ids + question
                out2 = llm.generate(prompt_token_ids=[second], sampling_params=one)[0]
            assert out1.ok and out2.ok, (out1.error, out2.error)
            ttft[caching].append(out2.metrics.ttft)
            tokens[caching] = out1.token_ids + out2.token_ids
            if caching:
                cached = out2.metrics.cached_tokens
            log(
                f"round {r}: cache {'on ' if caching else 'off'} turn 2 of {len(second)} tokens, "
                f"TTFT {out2.metrics.ttft:.3f} s, cached {out2.metrics.cached_tokens}"
            )
        ratios.append(ttft[True][-1] / ttft[False][-1])
    return dict(
        prompt_tokens=len(second),
        cached_tokens=cached,
        ttft_cached_s=statistics.median(ttft[True]),
        ttft_uncached_s=statistics.median(ttft[False]),
        ratio=statistics.median(ratios),
        same_tokens=tokens[True] == tokens[False],
    )


def n_completions(placement: str) -> dict:
    out = {}
    params = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=8, ignore_eos=True)
    for caching in (True, False):
        with _engine(caching, placement) as llm:
            prompt = _text(llm, N_PROMPT_TOKENS)
            res = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            assert res.ok, res.error
            prefilled = sum(int(s["tokens"]) for s in llm.last_run_stats if not s["decode"])
        out[caching] = ([o.token_ids for o in res.outputs], prefilled)
        log(f"n=4 cache {'on ' if caching else 'off'}: {prefilled} prompt tokens prefilled")
    return dict(
        prompt_tokens=N_PROMPT_TOKENS,
        prefilled_cached=out[True][1],
        prefilled_uncached=out[False][1],
        same_tokens=out[True][0] == out[False][0],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", choices=("hisparse", "gpu"), default="hisparse")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        # one thread: on a shared CPU the small ops of a short prefill otherwise wait on
        # descheduled pool threads at every barrier, which a long prefill amortizes
        torch.set_num_threads(args.threads)
    conv = conversation(args.placement, args.repeats)
    nres = n_completions(args.placement)
    result = dict(placement=args.placement, threads=args.threads, conversation=conv, n4=nres)
    log(
        f"\nturn 2 ({conv['prompt_tokens']} tokens, {conv['cached_tokens']} cached): TTFT "
        f"{conv['ttft_cached_s']:.3f} s cached vs {conv['ttft_uncached_s']:.3f} s, "
        f"ratio {conv['ratio']:.3f}; same tokens: {conv['same_tokens']}"
    )
    log(
        f"n=4 over {nres['prompt_tokens']} tokens: {nres['prefilled_cached']} prefilled cached "
        f"vs {nres['prefilled_uncached']}; same tokens: {nres['same_tokens']}"
    )
    out = args.out or (os.path.join(os.environ["OUT"], "bench_prefix_cache.json")
                       if os.environ.get("OUT") else None)  # fmt: skip
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return 0 if conv["same_tokens"] and nres["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
