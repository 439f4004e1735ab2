"""Quality of SmolLM2 with sparse attention against dense: needle in a haystack and perplexity.

The bundled SmolLM2-135M-Instruct GGUF (fp32 by default), on the CPU or on CUDA. For each top_k
(and dense):
- needle in a haystack: a passphrase sentence hidden at several depths of a long passage of
  the Python language reference (``pydoc_data``, ships with every Python), then a chat question
  asking for it; success when the greedy answer contains the passphrase;
- perplexity of the same reference text (the model's own prefill with each token attending to
  its top-k, exactly what decode would select).

Usage::

    PYTHONPATH=src python benchmarks/quality.py --device cuda --lengths 2048,4096,8192 --out DIR
    python benchmarks/quality.py --device cpu --lengths 2048,4096 --ppl-len 2048

A prompt never exceeds the model's context (8192 for SmolLM2) minus the answer's tokens, so
"8192" means the longest haystack that fits. Writes ``quality.json`` after every case and, when
matplotlib is installed, ``quality.png`` (needle retrieval per length and perplexity per
budget) under ``--out`` (default ``$OUT`` or ``.``), and prints the tables for docs/quality.md.
``--plot-from quality.json`` only draws the PNG of a finished run (no model run).
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
from hisparse.models.gguf_loader import load_llama_gguf, read_gguf
from hisparse.models.smollm2 import smollm2_gguf_path
from hisparse.models.tokenizer import GgufTokenizer

NEEDLE = "The secret passphrase is violet-kangaroo-42."
ANSWER = "violet-kangaroo-42"
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with it only."
ANSWER_TOKENS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def haystack_ids(tok: GgufTokenizer, text_ids: list[int], length: int, depth: float) -> list[int]:
    """A chat prompt of about ``length`` tokens with the needle at ``depth`` of the passage."""
    overhead = len(tok.encode_chat([{"role": "user", "content": NEEDLE + "\n\n" + QUESTION}]))
    body = text_ids[: max(length - overhead, 16)]
    cut = int(len(body) * depth)
    passage = tok.decode(body[:cut]) + "\n" + NEEDLE + "\n" + tok.decode(body[cut:])
    ids = tok.encode_chat([{"role": "user", "content": passage + "\n\n" + QUESTION}])
    # Re-tokenising around the needle can add a few tokens: trim the passage's tail to fit.
    while len(ids) > length and len(body) > 16:
        body = body[: len(body) - (len(ids) - length)]
        cut = int(len(body) * depth)
        passage = tok.decode(body[:cut]) + "\n" + NEEDLE + "\n" + tok.decode(body[cut:])
        ids = tok.encode_chat([{"role": "user", "content": passage + "\n\n" + QUESTION}])
    return ids


def budget_name(top_k: int | None) -> str:
    return "dense" if top_k is None else str(top_k)


def run_grid(
    model,
    tok: GgufTokenizer,
    text_ids: list[int],
    lengths: list[int],
    depths: list[float],
    budgets: list[int | None],
    ppl_len: int,
    out_dir: Path,
    meta: dict,
) -> dict[str, dict]:
    """Every (budget, length, depth) needle case and one perplexity per budget; the JSON is
    rewritten after every case, so a stopped run keeps what it measured."""
    device = model.device
    results: dict[str, dict] = {}
    cases = [(k, n, d) for k in budgets for n in lengths for d in depths]
    bar = tqdm(total=len(cases) + len(budgets), desc="quality", unit="run")

    def save() -> None:
        (out_dir / "quality.json").write_text(json.dumps({"meta": meta, **results}, indent=1))

    for k in budgets:
        model.set_indexer(GqaIndexerConfig(top_k=k))
        res = results.setdefault(budget_name(k), {"niah": {}, "ppl": None})
        for n in lengths:
            for d in depths:
                ids = haystack_ids(tok, text_ids, n, d)
                _sync(device)
                t0 = time.perf_counter()
                (out,) = model.generate_greedy([ids], ANSWER_TOKENS, stop_ids=tok.stop_token_ids)
                _sync(device)
                answer = tok.decode(out, skip_special_tokens=True)
                res["niah"][f"{n}@{d}"] = {
                    "tokens": len(ids), "found": ANSWER in answer, "answer": answer,
                    "seconds": time.perf_counter() - t0,
                }  # fmt: skip
                bar.update(1)
                save()
        ids = text_ids[:ppl_len]
        (logits,) = model.prefill_logits([ids])
        target = torch.tensor(ids[1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
        res["ppl"] = math.exp(float(nll))
        del logits
        bar.update(1)
        save()
    bar.close()
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_tables(results: dict[str, dict], lengths: list[int], depths: list[float],
                 ppl_len: int) -> None:  # fmt: skip
    print(f"\nNeedle retrieval (found / cases, depths {depths}) and perplexity of the Python "
          f"reference ({ppl_len} tokens):\n")  # fmt: skip
    print("| top_k | " + " | ".join(f"NIAH {n}" for n in lengths) + " | perplexity |")
    print("|---|" + "---|" * len(lengths) + "---|")
    for name, res in results.items():
        cells = []
        for n in lengths:
            found = [res["niah"][f"{n}@{d}"]["found"] for d in depths]
            marks = " ".join("✓" if f else "✗" for f in found)
            cells.append(f"{sum(found)}/{len(depths)} ({marks})")
        ppl = "–" if res["ppl"] is None else f"{res['ppl']:.3f}"
        print(f"| {name} | " + " | ".join(cells) + f" | {ppl} |")


def plot(results: dict[str, dict], lengths: list[int], depths: list[float], path: Path,
         title: str) -> bool:  # fmt: skip
    """Needle retrieval vs context length per budget, and perplexity per budget (PNG).
    False when matplotlib is not installed (CPU CI does not need it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(results))
    for i, (name, res) in enumerate(results.items()):
        found = [sum(res["niah"][f"{n}@{d}"]["found"] for d in depths) for n in lengths]
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(lengths))]
        ax1.bar(xs, found, width, label=name if name == "dense" else f"top_k {name}")
    ax1.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax1.set_ylim(0, len(depths) + 0.2)
    ax1.set_yticks(range(len(depths) + 1))
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel(f"needles found (of {len(depths)} depths)")
    ax1.legend(fontsize=8)
    names = [n for n in results if results[n]["ppl"] is not None]
    ax2.bar(names, [results[n]["ppl"] for n in names], color="tab:gray")
    if "dense" in names:
        ax2.axhline(results["dense"]["ppl"], color="k", lw=0.8, ls="--")
    lo = min(results[n]["ppl"] for n in names) if names else 0
    ax2.set_ylim(0.97 * lo, None)
    ax2.set_xlabel("top_k")
    ax2.set_ylabel("perplexity")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def replot(json_path: Path, out_dir: Path) -> None:
    """Draw the PNG of a finished run elsewhere (the GPU machine may lack matplotlib)."""
    data = json.loads(json_path.read_text())
    meta = data.pop("meta")
    title = f"SmolLM2-135M-Instruct, sparse top_k vs dense ({meta['device']}, {meta['dtype']})"
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "quality.png"
    if not plot(data, meta["lengths"], meta["depths"], png, title):
        raise SystemExit("matplotlib is not installed: pip install matplotlib")
    print_tables(data, meta["lengths"], meta["depths"], meta["ppl_len"])
    print(f"\nwrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cpu", "cuda"))  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--top-k", default="128,256,512,1024")
    ap.add_argument("--ppl-len", type=int, default=4096)
    ap.add_argument("--model", default=None, help="a Llama .gguf file (default: SmolLM2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plot-from", default=None,
                    help="only draw quality.png from this quality.json (no model run)")  # fmt: skip
    args = ap.parse_args()
    if args.plot_from:
        replot(Path(args.plot_from), Path(args.out))
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = Path(args.model) if args.model else smollm2_gguf_path()
    gf = read_gguf(path)
    model = load_llama_gguf(gf, dtype=DTYPES[args.dtype], device=device)
    tok = GgufTokenizer.from_gguf(gf)
    text_ids = tok.encode(reference_text(), add_special_tokens=False)
    fit = model.config.max_position_embeddings - ANSWER_TOKENS
    lengths = [min(int(x), fit) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    budgets: list[int | None] = [None] + [int(x) for x in args.top_k.split(",")]
    ppl_len = min(args.ppl_len, model.config.max_position_embeddings)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "model": path.name, "lengths": lengths, "depths": depths,
        "ppl_len": ppl_len, "torch": torch.__version__, "answer_tokens": ANSWER_TOKENS,
    }  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = run_grid(model, tok, text_ids, lengths, depths, budgets, ppl_len, out_dir, meta)
    print(f"\n{len(budgets)} budgets in {time.perf_counter() - t0:.0f} s on {meta['device']}")
    print_tables(results, lengths, depths, ppl_len)
    title = f"SmolLM2-135M-Instruct, sparse top_k vs dense ({meta['device']}, {args.dtype})"
    png = out_dir / "quality.png"
    if plot(results, lengths, depths, png, title):
        print(f"\nwrote {out_dir / 'quality.json'} and {png}")
    else:
        print(f"\nwrote {out_dir / 'quality.json'} (no plot: matplotlib is not installed)")


if __name__ == "__main__":
    main()
