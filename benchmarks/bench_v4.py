"""DeepSeek-V4 on a GPU: the attention kernel against its reference, and decode through the engine.

Run on the GPU machine: ``PYTHONPATH=src python benchmarks/bench_v4.py``.

1. Kernel (`v4_attention_triton`): V4-Flash's attention (64 heads of 512, one K = V head, bf16)
   over a window of 128 rows plus the entries of a CSA layer (top-k 512) and of an HCA layer
   at 128K tokens (1024 entries), batches of 1, 8 and 32 query tokens, rows at random in a
   pool of ~2 GiB: median µs of one call (``triton.testing.do_bench``) and of its CUDA-graph
   replay (``do_bench_cudagraph``, as the captured decode step runs it), the GB/s of the rows
   it must read, and the max abs error against `v4_attention_paged_reference` (fp32) in the
   same run.
2. Engine: a ``v4-attention`` checkpoint (`v4_tiny`: V4-Flash's attention in 2 layers, CSA and
   HCA, bf16) written to a temporary folder; `hisparse.LLM` decodes ``--output-len`` tokens for
   ``--batch`` prompts of ``--input-len`` tokens in each of ``--placements`` (all rows on the
   GPU; HiSparse with ``offload="always"``, so every CSA entry outside the two tail pages
   comes through the hot buffers: design §20.2), once with the fixed-shape step run eagerly
   (V4's default) and once captured as CUDA graphs (``cuda_graphs=True``): decode tokens/s,
   hits and misses, and whether every run gives the all-GPU eager run's tokens.

``--cpu-smoke`` runs small shapes on the CPU (Triton's interpreter) to check the script.
Prints a table and writes JSON to ``$OUT/bench_v4.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def bench_kernel(dev: torch.device, smoke: bool) -> list[dict]:
    import triton

    from hisparse.attention.v4_attention_reference import v4_attention_paged_reference
    from hisparse.attention.v4_attention_triton import v4_attention_triton

    h, d, window = (4, 32, 8) if smoke else (64, 512, 128)
    dtype = torch.float32 if smoke else torch.bfloat16
    bs, values = 64, 2 * d + 128  # a CSA row: window, entry, indexer entry
    blocks = 16 if smoke else (2 << 30) // (bs * values * 2)
    pool = torch.randn(blocks, bs, values, device=dev, dtype=dtype)
    rows = []
    for layer, entries in (
        ("CSA top-k 512", 8 if smoke else 512),
        ("HCA 128K", 4 if smoke else 1024),
    ):
        for batch in (1, 8) if smoke else (1, 8, 32):
            q = torch.randn(batch, h, d, device=dev, dtype=dtype)
            k = window + entries
            idx = torch.randint(0, blocks * bs, (batch, k), device=dev, dtype=torch.int32)
            sinks = torch.randn(h, device=dev)
            args = (q, pool, idx, window, d, sinks, d**-0.5)
            want = v4_attention_paged_reference(q.float(), pool.float(), *args[2:])
            got = v4_attention_triton(*args)
            err = float((got.float() - want).abs().max())
            if smoke:
                us = us_graph = float("nan")
            else:
                call = lambda a=args: v4_attention_triton(*a)  # noqa: E731
                us = triton.testing.do_bench(call) * 1e3
                # replayed as a CUDA graph, as the engine's captured decode step runs it: the
                # eager figure also pays Python's launches of the call's ~10 ops
                us_graph = triton.testing.do_bench_cudagraph(call) * 1e3
            nbytes = batch * k * d * pool.element_size()
            gb_s = nbytes / us_graph / 1e3 if us_graph == us_graph else None
            rows.append(dict(layer=layer, batch=batch, rows=k, us=us, us_graph=us_graph,
                             gb_s=gb_s, max_abs_err=err))  # fmt: skip
    return rows


def bench_engine(args: argparse.Namespace, dev: torch.device) -> list[dict]:
    from hisparse import LLM, HiSparseConfig, SamplingParams
    from hisparse.models.v4_tiny import make_tiny_v4

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        preset = "tiny" if args.cpu_smoke else "v4-attention"
        ckpt = make_tiny_v4(Path(tmp) / "v4", preset)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 4000 if not args.cpu_smoke else 500, (args.input_len,),
                                 generator=g).tolist() for _ in range(args.batch)]  # fmt: skip
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        tokens = {}
        runs = [(p.strip(), graphs) for p in args.placements.split(",") for graphs in (False, True)]
        for placement, graphs in runs:
            llm = LLM(ckpt, kv_placement=placement, device=str(dev), cuda_graphs=graphs or None,
                      max_num_seqs=args.batch, max_model_len=args.input_len + args.output_len + 8,
                      gpu_memory_gib=args.gpu_memory_gib,
                      hisparse=HiSparseConfig(offload="always"))  # fmt: skip
            try:
                llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)  # warm-up
                t0 = time.perf_counter()
                res = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                wall = time.perf_counter() - t0
                path = llm.runner.decode_path
            finally:
                llm.close()
            tokens[(placement, graphs)] = [r.outputs[0].token_ids for r in res]
            ttft = max(r.metrics.ttft for r in res)
            # decode: from the last request's first token to the last token of any
            first = max(r.metrics.first_token for r in res)
            decode_s = max(max(r.metrics.token_times[-1] for r in res) - first, 1e-9)
            rate = args.batch * (args.output_len - 1) / decode_s
            out.append(dict(placement=placement, decode_path=path, batch=args.batch,
                            input_len=args.input_len, output_len=args.output_len, wall_s=wall,
                            ttft_s=ttft, decode_tok_s=rate,
                            hits=sum(r.metrics.hits for r in res),
                            misses=sum(r.metrics.misses for r in res)))  # fmt: skip
        first = tokens[runs[0]]
        for row, run in zip(out, runs, strict=True):
            row["same_tokens_as_first"] = tokens[run] == first
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--gpu-memory-gib", type=float, default=8.0)
    p.add_argument("--placements", default="gpu,hisparse", help="kv placements, in order")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.batch, args.input_len, args.output_len, args.gpu_memory_gib = 2, 40, 4, 0.05
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    result = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        kernel=bench_kernel(dev, args.cpu_smoke),
        engine=bench_engine(args, dev),
    )
    print(f"{'layer':>14} {'batch':>5} {'rows':>5} {'us eager':>9} {'us graph':>9} {'GB/s':>7} "
          f"{'max err':>9}")  # fmt: skip
    for r in result["kernel"]:
        gb = f"{r['gb_s']:.0f}" if r["gb_s"] else "-"
        print(f"{r['layer']:>14} {r['batch']:>5} {r['rows']:>5} {r['us']:>9.1f} "
              f"{r['us_graph']:>9.1f} {gb:>7} {r['max_abs_err']:>9.2e}")  # fmt: skip
    for r in result["engine"]:
        print(f"engine {r['placement']:>8} {r['decode_path']:>7}: batch {r['batch']} x "
              f"{r['input_len']} tokens, decode {r['decode_tok_s']:.1f} tok/s, TTFT "
              f"{r['ttft_s']:.2f} s, hits {r['hits']} misses {r['misses']}, same tokens "
              f"{r['same_tokens_as_first']}")  # fmt: skip
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "bench_v4.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
