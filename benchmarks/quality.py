"""Quality of SmolLM2 with sparse attention against dense: needle in a haystack and perplexity.

Runs on the CPU (the bundled SmolLM2-135M-Instruct GGUF, fp32). For each top_k (and dense):
- needle in a haystack: a passphrase sentence hidden at several depths of a long passage of
  the Python language reference (``pydoc_data``, ships with every Python), then a chat question
  asking for it; success when the greedy answer contains the passphrase;
- perplexity of the same reference text (the model's own prefill with each token attending to
  its top-k, exactly what decode would select).

Usage: ``python benchmarks/quality.py [--lengths 2048,4096,8192] [--top-k 128,256,512,1024]``.
Writes ``quality.json`` (``$OUT`` or ``--out``) and prints the tables for docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
from hisparse.models.gguf_loader import load_llama_gguf
from hisparse.models.smollm2 import smollm2_gguf_path
from hisparse.models.tokenizer import GgufTokenizer

NEEDLE = "The secret passphrase is violet-kangaroo-42."
ANSWER = "violet-kangaroo-42"
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with it only."


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def haystack_ids(tok: GgufTokenizer, text_ids: list[int], length: int, depth: float) -> list[int]:
    """A chat prompt of about ``length`` tokens with the needle at ``depth`` of the passage."""
    overhead = len(tok.encode_chat([{"role": "user", "content": NEEDLE + "\n\n" + QUESTION}]))
    body = text_ids[: max(length - overhead, 16)]
    cut = int(len(body) * depth)
    passage = tok.decode(body[:cut]) + "\n" + NEEDLE + "\n" + tok.decode(body[cut:])
    return tok.encode_chat([{"role": "user", "content": passage + "\n\n" + QUESTION}])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--top-k", default="128,256,512,1024")
    ap.add_argument("--ppl-len", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = smollm2_gguf_path()
    model = load_llama_gguf(path, dtype=torch.float32)
    tok = GgufTokenizer.from_gguf(path)
    text_ids = tok.encode(reference_text(), add_special_tokens=False)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    budgets: list[int | None] = [None] + [int(x) for x in args.top_k.split(",")]
    results: dict[str, dict] = {}
    cases = [(k, n, d) for k in budgets for n in lengths for d in depths]
    bar = tqdm(total=len(cases) + len(budgets), desc="quality", unit="run")
    for k in budgets:
        name = "dense" if k is None else str(k)
        model.set_indexer(GqaIndexerConfig(top_k=k))
        res = results.setdefault(name, {"niah": {}, "ppl": None})
        for n in lengths:
            for d in depths:
                ids = haystack_ids(tok, text_ids, n, d)
                t0 = time.perf_counter()
                (out,) = model.generate_greedy([ids], 24, stop_ids=tok.stop_token_ids)
                answer = tok.decode(out, skip_special_tokens=True)
                res["niah"][f"{n}@{d}"] = {
                    "tokens": len(ids), "found": ANSWER in answer, "answer": answer,
                    "seconds": time.perf_counter() - t0,
                }
                bar.update(1)
                Path(args.out, "quality.json").write_text(json.dumps(results, indent=1))
        ids = text_ids[: args.ppl_len]
        (logits,) = model.prefill_logits([ids])
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
        res["ppl"] = math.exp(float(nll))
        bar.update(1)
        Path(args.out, "quality.json").write_text(json.dumps(results, indent=1))
    bar.close()
    print("\nNeedle retrieval (found / cases) and perplexity of the Python reference "
          f"({args.ppl_len} tokens):\n")
    print("| top_k | " + " | ".join(f"NIAH {n}" for n in lengths) + " | perplexity |")
    print("|---|" + "---|" * len(lengths) + "---|")
    for name, res in results.items():
        cells = []
        for n in lengths:
            found = sum(res["niah"][f"{n}@{d}"]["found"] for d in depths)
            cells.append(f"{found}/{len(depths)}")
        print(f"| {name} | " + " | ".join(cells) + f" | {res['ppl']:.3f} |")


if __name__ == "__main__":
    main()
