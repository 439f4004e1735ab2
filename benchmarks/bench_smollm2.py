"""SmolLM2 through our engine vs transformers' own ``generate``, same GGUF file, same prompt.

Run here (CPU) or on the GPU machine (no network needed: transformers reads the GGUF itself)::

    PYTHONPATH=src python benchmarks/bench_smollm2.py --device cpu --batch 1 --max-tokens 32
    PYTHONPATH=src python benchmarks/bench_smollm2.py --device cuda --batch 1,64 --max-tokens 128

For each batch size, one run of transformers (``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=name)``, greedy, its default attention and cache) and one run of our engine per
``--top-k`` (``dense`` = a budget at least the context, so every earlier token is attended),
side by side in one process, after a short warm-up of each. Every row of a batch gets the same
prompt (default: the demo's chat prompt, ~490 tokens; ``--prompt-len N`` builds one of about N
tokens from the Python reference). Both ignore EOS and generate exactly ``--max-tokens``
(transformers with its generation config's EOS removed, so no logits are altered). Warm-up runs
of a few tokens come first (at the measured batch size on CUDA, where kernels compile).

Reported per run: TTFT (mean over the batch's requests, from the call), decode tok/s (tokens
produced after the last request's first token, over the time since), total tok/s (all output
tokens over the whole call), and ours/transformers ratios. Tokens must agree where the math is
the same: a dense budget at batch 1 in fp32 (the CPU default) gives transformers' tokens
exactly (a mismatch exits 1); in bf16 (the CUDA default) the kernels differ, so only the
common prefix is reported. Progress lines first, a short table last; JSON to
``$OUT/bench_smollm2.json`` (or ``--out``) when set.

``--ttft 512,2048`` measures the prefill instead: for each prompt length (built as for
``--prompt-len``) and budget, ``--repeats`` rounds of one transformers ``generate`` then one
engine run, each producing one token, interleaved so that load from other jobs hits both
sides alike; reported are the medians of the TTFTs and of the per-round ours/transformers
ratios.

On a shared CPU compare only the ratios of one run: other jobs on the cores move both sides.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hisparse.config import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.models.smollm2 import smollm2_gguf_path
from hisparse.models.tokenizer import GgufTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP_TOKENS = 4


def log(msg: str) -> None:
    print(msg, flush=True)


def build_prompt(tok: GgufTokenizer, prompt_len: int) -> list[int]:
    """The demo's chat prompt, or a chat prompt of about ``prompt_len`` tokens."""
    from hisparse.cli_generate import demo_prompt

    if prompt_len <= 0:
        return tok.encode_chat([{"role": "user", "content": demo_prompt()}])
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    body = tok.encode(text, add_special_tokens=False)[: max(16, prompt_len - 40)]
    content = tok.decode(body) + "\n\nSummarize this text in one sentence."
    return tok.encode_chat([{"role": "user", "content": content}])


class _TokenClock:
    """A transformers streamer that only records when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def rates(
    starts: list[float], token_times: list[list[float]], end: float, n_out: int
) -> dict[str, float]:
    """TTFT (mean), decode tok/s after the last first token, total tok/s over the call."""
    ttft = sum(t[0] - s for s, t in zip(starts, token_times, strict=True)) / len(token_times)
    t_dec = max(t[0] for t in token_times)
    last = max(t[-1] for t in token_times)
    n_dec = sum(sum(1 for x in t if x > t_dec) for t in token_times)
    decode = n_dec / (last - t_dec) if last > t_dec else float("nan")
    total = n_out / (end - min(starts))
    return {"ttft_s": ttft, "decode_tok_s": decode, "total_tok_s": total}


def run_transformers(model, prompt: list[int], batch: int, max_tokens: int, device) -> dict:
    ids = torch.tensor([prompt] * batch, device=device)
    mask = torch.ones_like(ids)
    clock = _TokenClock()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, streamer=clock
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    tokens = out[:, len(prompt) :].tolist()
    n_out = sum(len(t) for t in tokens)
    if n_out != batch * max_tokens:
        raise RuntimeError(f"transformers produced {n_out} tokens, not {batch * max_tokens}")
    res = rates([start] * batch, [clock.times] * batch, end, n_out)
    return {**res, "tokens": tokens, "seconds": end - start}


def run_ours(llm: LLM, prompt: list[int], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[prompt] * batch, sampling_params=params)
    end = time.perf_counter()
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"engine error: {bad[0]}")
    times = [o.metrics.token_times for o in outs]
    arrivals = [o.metrics.arrival for o in outs]
    n_out = sum(len(o.token_ids) for o in outs)
    res = rates([max(a, start) for a in arrivals], times, end, n_out)
    hits = sum(o.metrics.hits for o in outs)
    misses = sum(o.metrics.misses for o in outs)
    return {**res, "tokens": [o.token_ids for o in outs], "seconds": end - start,
            "hit_rate": hits / max(1, hits + misses), "rows_swapped_in": misses}  # fmt: skip


def make_llm(
    args: argparse.Namespace, path: Path, top_k: int, batch: int, max_model_len: int,
    dtype_name: str,
) -> LLM:  # fmt: skip
    """Our engine at one budget, its host pool (and on the CPU its device pool, at least
    1 GiB: a dense budget's hot buffer) sized for ``batch`` requests of ``max_model_len``
    tokens."""
    row_bytes = 2 * 3 * 64 * DTYPES[dtype_name].itemsize * 30  # SmolLM2 rows of all layers
    host_gib = max(0.25, 2.5 * batch * max_model_len * row_bytes / 2**30)
    cfg = HiSparseConfig(top_k=top_k, host_pool_gib=host_gib)
    gpu_gib = args.gpu_memory_gib if args.device == "cuda" else max(1.0, host_gib)
    graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
    return LLM(str(path), kv_placement=args.placement, hisparse=cfg, max_num_seqs=batch,
               max_model_len=max_model_len, dtype=dtype_name, device=args.device,
               gpu_memory_gib=gpu_gib, cuda_graphs=graphs,
               async_scheduling=args.async_scheduling == "on",
               enable_prefix_caching=False)  # fmt: skip  # --ttft repeats its prompts


def run_ttft(
    args: argparse.Namespace, ref, tok: GgufTokenizer, path: Path, dtype_name: str
) -> list[dict]:
    """``--ttft``: per prompt length and budget, ``--repeats`` rounds of one transformers
    ``generate`` then one engine run, one new token each (batch 1); one engine at a time
    (one host pool per process)."""
    device = torch.device(args.device)
    rows: list[dict] = []
    for n in (int(x) for x in args.ttft.split(",")):
        prompt = build_prompt(tok, n)
        max_model_len = 64 * math.ceil((len(prompt) + 2) / 64)
        for k in [max_model_len if k == "dense" else int(k) for k in args.top_k.split(",")]:
            llm = make_llm(args, path, k, 1, max_model_len, dtype_name)
            hf: list[float] = []
            ours: list[float] = []
            same = True
            try:
                # Warm-up round (numba compiles on the first CPU prefill; CUDA kernels too).
                run_transformers(ref, prompt, 1, 1, device)
                run_ours(llm, prompt, 1, 1)
                for _ in range(args.repeats):
                    h = run_transformers(ref, prompt, 1, 1, device)
                    o = run_ours(llm, prompt, 1, 1)
                    hf.append(h["ttft_s"])
                    ours.append(o["ttft_s"])
                    same &= o["tokens"] == h["tokens"]
            finally:
                llm.close()
                del llm
                gc.collect()
            ratios = [o / h for o, h in zip(ours, hf, strict=True)]
            row = {
                "prompt_tokens": len(prompt), "top_k": k, "dense": k >= len(prompt) + 1,
                "ours_s": ours, "transformers_s": hf,
                "ours_median_s": statistics.median(ours),
                "transformers_median_s": statistics.median(hf),
                "ratio_median": statistics.median(ratios), "first_token_same": same,
            }  # fmt: skip
            rows.append(row)
            log(f"prompt {len(prompt)} top_k {k}: TTFT ours {row['ours_median_s']:.3f} s, "
                f"transformers {row['transformers_median_s']:.3f} s, ratio "
                f"{row['ratio_median']:.2f} (median of {args.repeats})")  # fmt: skip
    return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a Llama .gguf file (default: SmolLM2)")
    ap.add_argument(
        "--top-k",
        default="256,dense",
        help="our budgets, comma-separated; 'dense' = at least the context",
    )
    ap.add_argument("--placement", default="hisparse", choices=("hisparse", "gpu"))
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="auto: float32 on the CPU, bfloat16 on CUDA (both sides)",
    )
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=0,
        help="about this many prompt tokens (0: the demo prompt)",
    )
    ap.add_argument("--gpu-memory-gib", type=float, default=16.0,
                    help="our engine's GPU KV pool on CUDA")  # fmt: skip
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                    help="our decode steps as CUDA graphs (auto: on CUDA)")  # fmt: skip
    ap.add_argument("--async-scheduling", default="on", choices=("on", "off"),
                    help="LLM(async_scheduling=): decodes launched before the last one's "
                    "tokens are read")  # fmt: skip
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--ttft", default="", help="prompt lengths: measure TTFT only (batch 1)")
    ap.add_argument("--repeats", type=int, default=5, help="--ttft rounds per prompt length")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")  # fmt: skip
    dtype = DTYPES[dtype_name]
    path = Path(args.model) if args.model else smollm2_gguf_path()
    batches = [int(b) for b in args.batch.split(",")]

    log(f"model {path} on {device} ({dtype_name}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads")  # fmt: skip
    tok = GgufTokenizer.from_gguf(path)
    prompt = build_prompt(tok, args.prompt_len)
    ctx = len(prompt) + args.max_tokens
    max_model_len = 64 * math.ceil((ctx + 1) / 64)
    budgets = [max_model_len if k == "dense" else int(k) for k in args.top_k.split(",")]
    if not args.ttft:
        log(f"prompt {len(prompt)} tokens, {args.max_tokens} new, context {ctx}; "
            f"budgets {budgets} (dense = {max_model_len})")  # fmt: skip

    import transformers

    t0 = time.perf_counter()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).to(device).eval()  # fmt: skip
    log(f"transformers {transformers.__version__} loaded in {time.perf_counter() - t0:.1f} s")
    # Never stop at EOS (ours: ignore_eos): both then produce exactly --max-tokens argmax tokens.
    ref.generation_config.eos_token_id = None
    if ref.generation_config.pad_token_id is None:
        ref.generation_config.pad_token_id = 0

    if args.ttft:
        return ttft_report(args, run_ttft(args, ref, tok, path, dtype_name), dtype_name)
    results: list[dict] = []
    for batch in batches:
        # Warm-up at the measured batch size on CUDA (kernels compile per shape class).
        warm = batch if device.type == "cuda" else 1
        run_transformers(ref, prompt, warm, WARMUP_TOKENS, device)
        hf = run_transformers(ref, prompt, batch, args.max_tokens, device)
        log(f"batch {batch} transformers: decode {hf['decode_tok_s']:.1f} tok/s, TTFT "
            f"{hf['ttft_s']:.3f} s, total {hf['total_tok_s']:.1f} tok/s")  # fmt: skip
        for k in budgets:
            t0 = time.perf_counter()
            llm = make_llm(args, path, k, batch, max_model_len, dtype_name)
            load_s = time.perf_counter() - t0
            decode_path = llm.runner.decode_path
            try:
                run_ours(llm, prompt, warm, WARMUP_TOKENS)
                ours = run_ours(llm, prompt, batch, args.max_tokens)
            finally:
                llm.close()
                del llm
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            dense = k >= ctx
            same = common_prefix(ours["tokens"][0], hf["tokens"][0])
            row = {
                "batch": batch, "top_k": k, "dense": dense, "placement": args.placement,
                "decode_path": decode_path,
                "load_s": load_s, "ours": ours, "transformers": hf,
                "decode_ratio": ours["decode_tok_s"] / hf["decode_tok_s"],
                "ttft_ratio": ours["ttft_s"] / hf["ttft_s"],
                "total_ratio": ours["total_tok_s"] / hf["total_tok_s"],
                "same_prefix": same, "all_same": same == args.max_tokens,
            }  # fmt: skip
            results.append(row)
            log(f"batch {batch} ours top_k {k} ({decode_path}): decode "
                f"{ours['decode_tok_s']:.1f} tok/s "
                f"({row['decode_ratio']:.2f}x), TTFT {ours['ttft_s']:.3f} s, total "
                f"{ours['total_tok_s']:.1f} tok/s, hit rate {100 * ours['hit_rate']:.1f}%, "
                f"first {same}/{args.max_tokens} tokens of request 0 equal HF's")  # fmt: skip

    meta = {
        "device": str(device), "dtype": dtype_name, "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "model": str(path),
    }  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = Path(args.out, "bench_smollm2.json")
        out.write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        log(f"wrote {out}")
        sys.path.insert(0, str(Path(__file__).parent))
        from plot_smollm2 import plot

        log(plot([{"meta": meta, "runs": results}], Path(args.out, "bench_smollm2.png")))

    print(f"\n{device} {dtype_name}, prompt {len(prompt)} tokens, {args.max_tokens} new tokens")
    print(
        "| batch | top_k | decode tok/s ours / HF (x) | TTFT s ours / HF | "
        "total tok/s ours / HF (x) | tokens = HF |"
    )
    print("|---|---|---|---|---|---|")
    failed = False
    for r in results:
        o, h = r["ours"], r["transformers"]
        k = f"{r['top_k']} (dense)" if r["dense"] else str(r["top_k"])
        must = r["dense"] and r["batch"] == 1 and dtype == torch.float32
        agree = "yes" if r["all_same"] else f"first {r['same_prefix']}"
        if must and not r["all_same"]:
            agree += " MISMATCH"
            failed = True
        print(f"| {r['batch']} | {k} | {o['decode_tok_s']:.1f} / {h['decode_tok_s']:.1f} "
              f"({r['decode_ratio']:.2f}) | {o['ttft_s']:.3f} / {h['ttft_s']:.3f} | "
              f"{o['total_tok_s']:.1f} / {h['total_tok_s']:.1f} ({r['total_ratio']:.2f}) | "
              f"{agree} |")  # fmt: skip
    return 1 if failed else 0


def ttft_report(args: argparse.Namespace, rows: list[dict], dtype_name: str) -> int:
    """The ``--ttft`` table (and JSON under ``--out``); 1 when a dense fp32 first token
    differs from transformers'."""
    meta = {
        "device": args.device, "dtype": dtype_name, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
    }  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = Path(args.out, "bench_smollm2_ttft.json")
        out.write_text(json.dumps({"meta": meta, "ttft": rows}, indent=1))
        log(f"wrote {out}")
    print(f"\n{args.device} {dtype_name}, {torch.get_num_threads()} threads, batch 1, "
          f"medians of {args.repeats}")  # fmt: skip
    print("| prompt tokens | top_k | TTFT s ours | TTFT s transformers | ours / transformers |")
    print("|---|---|---|---|---|")
    failed = False
    for r in rows:
        k = f"{r['top_k']} (dense)" if r["dense"] else str(r["top_k"])
        note = ""
        if r["dense"] and dtype_name == "float32" and not r["first_token_same"]:
            note, failed = " MISMATCH", True
        print(f"| {r['prompt_tokens']} | {k} | {r['ours_median_s']:.3f} | "
              f"{r['transformers_median_s']:.3f} | {r['ratio_median']:.2f}{note} |")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
