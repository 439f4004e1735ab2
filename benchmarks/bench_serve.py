"""Serving benchmark: `hisparse serve` in its own process, driven over HTTP by streaming clients.

Per placement: start ``python -m hisparse serve`` with the given engine flags, wait for
``/health``, warm it with two requests, then send ``--num-prompts`` completions (random token-id
prompts of ``--input-len``, ``--output-len`` new tokens, EOS ignored) at a Poisson
``--request-rate`` (``inf``: all at once) with at most ``--concurrency`` in flight, each
streamed. Reported: request throughput, output tokens/s, time to first token and inter-token
latency p50 / p95 / p99 (from the client's clock, per streamed event), errors. The server is
stopped at the end; results go to ``--out`` as JSON.

    python benchmarks/bench_serve.py --model smollm2 --device cpu --num-prompts 32
    python benchmarks/bench_serve.py --model /tmp/v32 --input-len 32768 --output-len 128 \\
        --num-prompts 32 --request-rate 2 -- --gpu-memory-gib 3 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

#: prompt token ids are drawn below this, or below a checkpoint's smaller vocabulary
PROMPT_VOCAB = 1000


def _prompt_vocab(model: str) -> int:
    """`PROMPT_VOCAB`, capped by ``vocab_size`` of a checkpoint folder's config.json."""
    config = Path(model) / "config.json"
    if config.is_file():
        return min(
            PROMPT_VOCAB, int(json.loads(config.read_text()).get("vocab_size", PROMPT_VOCAB))
        )
    return PROMPT_VOCAB


def _pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


async def _one(client: httpx.AsyncClient, ids: list[int], out_len: int) -> dict:
    body = dict(prompt=ids, max_tokens=out_len, temperature=0, ignore_eos=True, stream=True,
                stream_options=dict(include_usage=True))  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return dict(error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:  # one chunk per new token; its text may be empty (a
                times.append(time.perf_counter())  # partial character, or a tiny vocabulary)
    if not times:
        return dict(error="no tokens")
    return dict(
        ttft=times[0] - t0,
        itl=[b - a for a, b in itertools.pairwise(times)],
        events=tokens,
        end=times[-1],
    )


async def _load(base: str, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    limit = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        for warm in prompts[:2]:
            await _one(client, warm[: min(64, len(warm))], 4)

        async def run(ids: list[int]) -> dict:
            async with limit:
                return await _one(client, ids, args.output_len)

        tasks = []
        t0 = time.perf_counter()
        for ids in prompts:
            tasks.append(asyncio.create_task(run(ids)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    return dict(
        requests=len(results),
        completed=len(ok),
        errors=[r["error"] for r in results if "error" in r][:5],
        wall_s=wall,
        req_per_s=len(ok) / wall,
        output_tok_s=sum(r["events"] for r in ok) / wall,
        **{f"ttft_p{q}_s": _pct(ttft, q / 100) for q in (50, 95, 99)},
        **{f"itl_p{q}_ms": 1e3 * _pct(itl, q / 100) for q in (50, 95, 99)},
    )


def _serve(args: argparse.Namespace, placement: str, port: int, extra: list[str]):
    cmd = [sys.executable, "-m", "hisparse", "serve", "--model", args.model, "--port", str(port),
           "--kv-placement", placement, "--log-level", "warning", *extra]  # fmt: skip
    if args.device:
        cmd += ["--device", args.device]
    return subprocess.Popen(cmd, env=os.environ.copy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--placements", default="hisparse,gpu")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--device", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    rows = []
    for placement in args.placements.split(","):
        proc = _serve(args, placement, args.port, extra)
        base = f"http://127.0.0.1:{args.port}"
        try:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the {placement} server exited with {proc.returncode}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not come up in time")
                time.sleep(0.5)
            row = asyncio.run(_load(base, args, _prompt_vocab(args.model)))
            row["placement"] = placement
            rows.append(row)
        finally:
            proc.terminate()
            proc.wait(60)
    title = (
        f"{args.num_prompts} requests x {args.input_len} + {args.output_len} tokens, rate "
        f"{args.request_rate}/s, concurrency <= {args.concurrency} ({args.model})"
    )
    t = Table(title=title)
    cols = ("placement", "done", "req/s", "out tok/s", "TTFT p50/p95/p99 s", "ITL p50/p95/p99 ms")
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(
            r["placement"], f"{r['completed']}/{r['requests']}", f"{r['req_per_s']:.2f}",
            f"{r['output_tok_s']:.1f}",
            f"{r['ttft_p50_s']:.2f}/{r['ttft_p95_s']:.2f}/{r['ttft_p99_s']:.2f}",
            f"{r['itl_p50_ms']:.1f}/{r['itl_p95_ms']:.1f}/{r['itl_p99_ms']:.1f}",
        )  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = dict(settings={k: str(v) for k, v in vars(args).items()}, extra=extra, rows=rows)
        (args.out / "bench_serve.json").write_text(json.dumps(doc, indent=2))
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
