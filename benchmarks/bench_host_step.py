"""The host's share of a decode step: many requests with long outputs through `hisparse.LLM`.

With async scheduling the host reads a step's tokens, checks stops and schedules the next
step while the GPU runs it; the GPU idles only where the host takes longer. This times the
engine's decode steps and the host's waits on the device (`torch.cuda.Event.synchronize` and
`torch.cuda.synchronize`, patched to count): host time per step = step time - wait. It uses
only the public API, so the same script times older trees (``--src``) side by side.

    python benchmarks/bench_host_step.py --model /tmp/v32 --requests 29 --output-len 8192 \
        --src src --src /tmp/base/src --json /tmp/host_step.json

Each ``--src`` runs in its own process (a fresh import of that tree); the table is last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args: argparse.Namespace) -> dict:
    import torch

    import hisparse

    waits = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                waits[0] += time.perf_counter() - t

        return wrapper

    if torch.cuda.is_available():
        torch.cuda.Event.synchronize = timed(torch.cuda.Event.synchronize)
        torch.cuda.synchronize = timed(torch.cuda.synchronize)
    llm = hisparse.LLM(
        args.model,
        kv_placement=args.placement,
        max_num_seqs=args.requests,
        max_model_len=args.input_len + args.output_len,
        gpu_memory_gib=args.gpu_memory_gib,
        max_num_batched_tokens=max(2048, args.input_len),
        enable_prefix_caching=False,  # every run prefills its prompts
    )
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = min(1000, config["vocab_size"])
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, vocab, (args.input_len,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    params = hisparse.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # warm-up: compile kernels and capture graphs at every padded size
    llm.generate(
        prompt_token_ids=prompts,
        sampling_params=hisparse.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    )
    waits[0] = 0.0
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    failed = [o.outputs[0].error for o in outs if o.outputs[0].finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    steps = [s for s in llm.last_run_stats if s["decode"]]
    full = [s["seconds"] for s in steps if s["running"] == args.requests]
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_s = sum(s["seconds"] for s in steps)
    total_steps = len(llm.last_run_stats)
    llm.close()
    return dict(
        src=hisparse.__file__,
        placement=args.placement,
        requests=args.requests,
        output_len=args.output_len,
        generated=n_tokens,
        steps=total_steps,
        decode_steps=len(steps),
        step_p50_ms=1e3 * statistics.median(full) if full else float("nan"),
        wall_s=wall,
        wait_s=waits[0],
        host_ms_per_step=1e3 * (wall - waits[0]) / max(1, total_steps),
        tok_s=n_tokens / wall,
        decode_tok_s=n_tokens / decode_s if decode_s else float("nan"),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=29)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=8192)
    p.add_argument("--gpu-memory-gib", type=float, default=16.0)
    p.add_argument("--placement", default="hisparse,gpu")
    p.add_argument("--src", action="append", default=None, help="source trees to time")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    rows = []
    for src in args.src or ["src"]:
        for placement in args.placement.split(","):
            cmd = [sys.executable, __file__, "--child", "--model", args.model,
                   "--requests", str(args.requests), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--placement", placement,
                   "--gpu-memory-gib", str(args.gpu_memory_gib)]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
            t = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{src} {placement}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
                continue
            row = json.loads(lines[-1][7:])
            row["tree"] = src
            rows.append(row)
            print(f"{src} {placement}: {time.perf_counter() - t:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print("| tree | placement | steps | step p50 ms (all running) | host ms/step | tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['placement']} | {r['steps']} | {r['step_p50_ms']:.3f} | "
              f"{r['host_ms_per_step']:.3f} | {r['tok_s']:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
