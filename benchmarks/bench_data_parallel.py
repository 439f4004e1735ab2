"""Data-parallel attention with expert parallelism on the CPU (docs/design.md §21): what each
rank holds in host memory, and what the lockstep costs, against one rank.

    PYTHONPATH=src python benchmarks/bench_data_parallel.py [--model DIR] [--prompts 8]

Builds (or reads ``--model``) a tiny DeepSeek-V3.2 checkpoint and generates the same greedy
batch with one rank, then with ``--ranks`` data-parallel ranks and the experts split over them
(HiSparse placement, every page offloaded). Reported per run: load and generate seconds,
output tokens per second, engine steps on rank 0, and per rank its process id, the requests it
ran, its pinned host pool's bytes and its process's resident memory (``VmRSS``, of it
``RssAnon``: the private pool is anonymous memory). The tokens must be the same (else exit 1).
JSON to ``$OUT/bench_data_parallel.json`` (or ``--out``) when set. On a shared CPU the times
are the contended machine's: compare only the memory and the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from hisparse.config import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams


def _status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` of process ``pid``, bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(value.split()[0]) * 1024
    return out


def run(model: str, ranks: int, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    llm = LLM(
        model,
        hisparse=HiSparseConfig(host_pool_gib=args.host_pool_gib, block_size=16, offload="always"),
        kv_format="bf16",
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_gib=0.05,
        data_parallel_size=ranks,
        enable_expert_parallel=ranks > 1,
    )
    load = time.perf_counter() - t0
    with llm:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        secs = time.perf_counter() - t0
        states = llm._tensor_parallel_state()
        core = llm._core
        assigned = getattr(core, "assigned", [len(prompts)])
        rank_rows = []
        for rank, st in enumerate(states):
            mem = _status(st["pid"])
            rank_rows.append(dict(rank=rank, pid=st["pid"], requests=assigned[rank],
                                  host_pool_bytes=st["host_pool"]["size"], **mem))  # fmt: skip
        steps = len(llm.last_run_stats)
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(ranks=ranks, load_s=load, generate_s=secs, tok_s=tokens / secs, steps=steps,
                per_rank=rank_rows, tokens=[o.token_ids for o in outs])  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a DSA checkpoint folder (default: a tiny one, made here)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--host-pool-gib", type=float, default=0.25)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    model = args.model
    if model is None:
        from hisparse.models.tiny import make_tiny

        model = str(make_tiny("deepseek_v32", tempfile.mkdtemp(prefix="bench-dp-")))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (args.input_len,), generator=g).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    results = [run(model, 1, prompts, args), run(model, args.ranks, prompts, args)]
    same = results[0]["tokens"] == results[1]["tokens"]
    for r in results:
        print(f"ranks {r['ranks']}: load {r['load_s']:.1f} s, generate {r['generate_s']:.2f} s, "
              f"{r['tok_s']:.1f} tok/s, {r['steps']} steps on rank 0")  # fmt: skip
        for row in r["per_rank"]:
            print(
                f"  rank {row['rank']} (pid {row['pid']}): {row['requests']} requests, host "
                f"pool {row['host_pool_bytes'] / 2**20:,.1f} MiB, VmRSS "
                f"{row['VmRSS'] / 2**20:,.0f} MiB (RssAnon {row['RssAnon'] / 2**20:,.0f})"
            )
        r.pop("tokens")
    print(f"tokens equal: {same}")
    out = args.out or (Path(os.environ["OUT"]) / "bench_data_parallel.json"
                       if os.environ.get("OUT") else None)  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(dict(results=results, tokens_equal=same), indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
