"""Where a real prefill's time goes, HiSparse against all-GPU placement (CUDA), or on the CPU.

For each placement: one warm-up prefill (kernel compilation), then ``--prompts`` prompts of
``--input-len`` tokens (one new token each) under ``torch.profiler``. Prints the wall time,
the GPU kernels' busy time and the host's busiest ops (a prefill that leaves the GPU idle is
host-bound), then the GPU kernels by total time for both placements side by side, so the
difference between the two is visible kernel by kernel; the full tables go to ``--out``.

    PYTHONPATH=src python3 benchmarks/profile_prefill.py --model /tmp/v32 --input-len 16384
    PYTHONPATH=src python3 benchmarks/profile_prefill.py --model smol.gguf --input-len 492 \
        --prompts 8 --max-batched-tokens 2048

``--device cpu`` (`cpu_prefill`): one HiSparse prefill of ``--input-len`` tokens of real text
(the Python reference that ships with Python, ``pydoc_data``) under ``cProfile``, after a
short warm-up (numba's kernels); prints tokens/s, the process's CPU seconds (which spinning
OpenMP workers inflate, and a busy machine's other processes do not) and the functions by
own CPU time (all threads', charged to the function the main thread is in):

    PYTHONPATH=src python3 benchmarks/profile_prefill.py --model smollm2 --device cpu \
        --input-len 7500 --max-batched-tokens 2048
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hisparse import LLM, HiSparseConfig, SamplingParams


def kernel_times(prof: profile) -> dict[str, float]:
    """Total device milliseconds per kernel name."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key] = out.get(e.key, 0.0) + t / 1e3
    return out


def cpu_prefill(args: argparse.Namespace) -> None:
    """The CPU mode (module docstring)."""
    import cProfile
    import os
    import pstats
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    with LLM(
        args.model,
        device="cpu",
        max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=False,  # a profiled prefill computes every token
    ) as llm:
        ids = llm.encode(text)[: args.input_len]
        one = SamplingParams(temperature=0, max_tokens=1)
        llm.generate(prompt_token_ids=[ids[:300]], sampling_params=one, use_tqdm=False)
        prof = cProfile.Profile(time.process_time)  # CPU seconds: other jobs' load aside
        cpu0, t0 = time.process_time(), time.perf_counter()
        with prof:
            (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=one, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    load = os.getloadavg()[0]
    print(
        f"{len(ids)} tokens, top_k {llm.config.top_k}, {torch.get_num_threads()} threads: "
        f"wall {wall:.1f} s ({len(ids) / wall:.1f} tok/s), process CPU {cpu:.1f} s "
        f"({len(ids) / cpu:.1f} tok/CPU-s), load average {load:.1f}; token {out.token_ids}"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=16384)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--prompts", type=int, default=1, help="prompts of --input-len tokens")
    p.add_argument("--placements", default="gpu,hisparse")
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (one HiSparse prefill)")
    args = p.parse_args()
    if args.device == "cpu":
        cpu_prefill(args)
        return
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0, max_tokens=1)
    results = {}
    for placement in args.placements.split(","):
        with LLM(
            args.model,
            kv_placement=placement,
            max_model_len=args.input_len + 8,
            max_num_seqs=args.prompts,
            max_num_batched_tokens=args.max_batched_tokens,
            gpu_memory_gib=8,
            hisparse=HiSparseConfig(host_pool_gib=4),
            enable_prefix_caching=False,  # a profiled prefill computes every token
        ) as llm:
            vocab = llm.model.config.vocab_size
            prompts = [
                torch.randint(0, vocab, (args.input_len,), generator=g).tolist()
                for _ in range(args.prompts)
            ]
            llm.generate(prompt_token_ids=prompts, sampling_params=one)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=one)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompt_token_ids=prompts, sampling_params=one)
                torch.cuda.synchronize()
        results[placement] = (wall, kernel_times(prof))
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        print(f"{placement}: wall {wall:.3f} s; host self time by op (ms):")
        for e in host:
            print(f"  {e.self_cpu_time_total / 1e3:9.1f} {e.count:7d}  {e.key[:80]}")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
            (args.out / f"profile_prefill_{placement}.txt").write_text(table)
    if len(results) == 1:
        ((placement, (wall, times)),) = results.items()
        print(f"{placement}: wall {wall:.3f} s, GPU kernel time {sum(times.values()):.1f} ms")
        for k in sorted(times, key=lambda k: -times[k])[: args.top]:
            print(f"{k[:70]:<70} {times[k]:>9.2f} ms")
        return
    (gw, gk), (hw, hk) = results["gpu"], results["hisparse"]
    print(f"wall (unprofiled): all-GPU {gw:.3f} s, HiSparse {hw:.3f} s ({hw / gw:.2f}x)")
    print(f"GPU kernel time:   all-GPU {sum(gk.values()):.1f} ms, HiSparse {sum(hk.values()):.1f}")
    names = sorted(set(gk) | set(hk), key=lambda k: -max(gk.get(k, 0), hk.get(k, 0)))
    print(f"{'kernel':<70} {'all-GPU ms':>11} {'HiSparse ms':>12}")
    for k in names[: args.top]:
        print(f"{k[:70]:<70} {gk.get(k, 0.0):>11.2f} {hk.get(k, 0.0):>12.2f}")
    diff = sorted(names, key=lambda k: -(hk.get(k, 0) - gk.get(k, 0)))[:8]
    print("largest HiSparse excess:")
    for k in diff:
        print(f"  {k[:70]:<70} {hk.get(k, 0.0) - gk.get(k, 0.0):+.2f} ms")


if __name__ == "__main__":
    main()
