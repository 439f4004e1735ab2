"""Speculative decoding with n-gram drafts against none, SmolLM2 on the CPU (issue #52).

    PYTHONPATH=src python benchmarks/bench_speculative.py [--rounds 3] [--out FILE]

Two engines, one at a time in one process, both the default configuration (HiSparse
placement, the default top_k and offload policy, greedy, batch 1: the CPU batch-1 fast path
serves every step that has no drafts): one without speculation, one with ``SPEC`` below. Two
fixed tasks, each one request: an input-grounded one (repeat a passage (at most 950 tokens) of the
Python reference with one word changed: the output copies the prompt, so prompt lookup finds
most drafts) and an open-ended chat question (few repeats: speculation must not cost much
where it misses). ``--rounds`` rounds alternate the two engines (each built afresh and
warmed up; load from other jobs hits both sides alike); reported per task and engine: the
median decode tok/s (tokens after the first over the time since it), the median ratio of
the rounds (speculative / none), the acceptance rate (drafts accepted of those verified),
the mean accepted length (tokens per verifying step) and whether the greedy tokens agree
(they must, unless at a near-tie of the logits: the verifying step rounds differently from
the one-row fast path). JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hisparse import LLM, SamplingParams

#: the speculative engine's configuration (fixed: the numbers in docs/benchmarks.md use it)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
MAX_TOKENS = 128
CHAT_QUESTION = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Give the keeper a name and describe the sea."
)


def tasks(llm: LLM) -> dict[str, list[int]]:
    """The two fixed prompts as chat token ids."""
    from pydoc_data.topics import topics

    passage = topics["for"] + "\n" + topics["while"]
    body = llm.tokenizer.encode(passage, add_special_tokens=False)[:950]
    text = llm.tokenizer.decode(body)
    grounded = (
        "Repeat the following passage exactly, word for word, but write 'loop' instead of "
        "'suite' everywhere.\n\n" + text
    )
    return {
        "grounded": llm.chat_token_ids([{"role": "user", "content": grounded}]),
        "chat": llm.chat_token_ids([{"role": "user", "content": CHAT_QUESTION}]),
    }


def run_once(llm: LLM, ids: list[int]) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=params)
    wall = time.perf_counter() - t0
    m = out.metrics
    assert out.ok, out.error
    n = len(out.token_ids)
    decode_s = m.finished - m.first_token
    return dict(
        tokens=out.token_ids,
        decode_tok_s=(n - 1) / decode_s,
        ttft_s=m.ttft,
        wall_s=wall,
        drafted=m.spec_drafted,
        accepted=m.spec_accepted,
        verify_steps=m.spec_steps,
        decode_steps=m.decode_steps,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    configs = {"none": None, "ngram": SPEC}
    results: dict[str, dict[str, list[dict[str, object]]]] = {}
    prompts: dict[str, list[int]] = {}
    for r in range(args.rounds):
        # one engine at a time (one host pool per process), built afresh each round
        for name, spec in configs.items():
            with LLM("smollm2", max_num_seqs=1, speculative_config=spec) as llm:
                prompts = prompts or tasks(llm)
                for ids in prompts.values():  # warm-up: compiled kernels, first-call costs
                    llm.generate(prompt_token_ids=[ids[:200]], sampling_params=SamplingParams(
                        temperature=0, max_tokens=8))  # fmt: skip
                for task, ids in prompts.items():
                    res = run_once(llm, ids)
                    results.setdefault(task, {n: [] for n in configs})[name].append(res)
                    print(f"round {r} {task} {name}: {res['decode_tok_s']:.2f} tok/s, "
                          f"accepted {res['accepted']}/{res['drafted']}", flush=True)  # fmt: skip
    summary = {}
    for task, runs in results.items():
        none, spec = runs["none"], runs["ngram"]
        drafted = sum(int(r["drafted"]) for r in spec)  # type: ignore[arg-type]
        accepted = sum(int(r["accepted"]) for r in spec)  # type: ignore[arg-type]
        steps = sum(int(r["verify_steps"]) for r in spec)  # type: ignore[arg-type]
        summary[task] = dict(
            prompt_tokens=len(prompts[task]),
            none_tok_s=statistics.median(r["decode_tok_s"] for r in none),  # type: ignore[misc]
            ngram_tok_s=statistics.median(r["decode_tok_s"] for r in spec),  # type: ignore[misc]
            ratio=statistics.median(
                s["decode_tok_s"] / n["decode_tok_s"]  # type: ignore[operator]
                for s, n in zip(spec, none, strict=True)
            ),
            acceptance_rate=accepted / drafted if drafted else None,
            mean_accepted_length=1 + accepted / steps if steps else None,
            decode_steps=(none[0]["decode_steps"], spec[0]["decode_steps"]),
            same_tokens=all(s["tokens"] == n["tokens"] for s, n in zip(spec, none, strict=True)),
        )
    print("\n| task | prompt tokens | none tok/s | ngram tok/s | ratio | acceptance | mean "
          "accepted length | decode steps none / ngram | same tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for task, s in summary.items():
        acc, mal = s["acceptance_rate"], s["mean_accepted_length"]
        print(
            f"| {task} | {s['prompt_tokens']} | {s['none_tok_s']:.2f} | {s['ngram_tok_s']:.2f} | "
            f"{s['ratio']:.2f}x | {'-' if acc is None else f'{acc:.0%}'} | "
            f"{'-' if mal is None else f'{mal:.2f}'} | {s['decode_steps'][0]} / "
            f"{s['decode_steps'][1]} | {s['same_tokens']} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(dict(spec=SPEC, max_tokens=MAX_TOKENS,
                                            summary=summary, runs=results), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
