"""Output processing per engine step: process CPU time of appending one sampled token to each
of 64 requests (text decoded, stop rules checked, two stop strings that never match), near
the end of outputs of 512 and of 8,192 tokens, on SmolLM2's tokenizer.

Two processors, same run, same token streams: `hisparse.engine.output_processor.
OutputProcessor` (incremental detokenization) and `FullRedecodeStopChecker`, a copy of the
engine's earlier ``StopChecker``, which decoded each request's whole output every token. The
streams are this repository's documentation (docs/*.md, README.md: English, code, tables,
a few non-ASCII characters) tokenized, each request starting elsewhere in it. A processor
takes the first ``L - steps`` tokens untimed (the full re-decode's requests are set up
directly: it keeps no state), then ``steps`` steps are timed one by one with
``time.process_time``; the table gives the median step in ms and the ratio 8192 / 512.

    PYTHONPATH=src python benchmarks/bench_output_processing.py [--plot out.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hisparse.engine.output_processor import OutputProcessor
from hisparse.engine.request import Request
from hisparse.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
STOP = ["<|never-stop-1|>", "\n\n###### never stop 2"]


class FullRedecodeStopChecker:
    """The engine's ``StopChecker`` before `OutputProcessor`: the same rules, with
    ``req.text`` re-decoded from all of the output on every token."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(
        self, req: Request, token: int, logprobs: dict[int, float] | None, now: float
    ) -> str | None:
        req.output_token_ids.append(token)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob = (req.cumulative_logprob or 0.0) + logprobs.get(token, 0.0)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.metrics.token_times.append(now)
        before = len(req.text)
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if p.stop:
                start = max(before - max(len(s) for s in p.stop) + 1, 0)
                hits = [(i, s) for s in p.stop if (i := req.text.find(s, start)) >= 0]
                if hits:
                    cut, req.stop_reason = min(hits)
                    req.text = req.text[:cut]
                    return "stop"
        if (p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens) or (
            req.num_tokens >= self.max_model_len
        ):
            return "length"
        return None


PROCESSORS = {
    "OutputProcessor": OutputProcessor,
    "FullRedecodeStopChecker": FullRedecodeStopChecker,
}


def streams(tokenizer: Any, requests: int, length: int) -> list[list[int]]:
    """``requests`` token streams of ``length`` from the documentation's tokens."""
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids * (length // len(ids) + 2)
    step = max(len(ids) // 2 // requests, 1)
    return [ids[i * step : i * step + length] for i in range(requests)]


def progress(msg: str) -> None:
    print(f"\r{msg:<72}", end="", file=sys.stderr, flush=True)


def measure(name: str, tokenizer: Any, toks: list[list[int]], steps: int) -> list[float]:
    """Per-step process CPU seconds of the last ``steps`` steps of ``toks``."""
    proc = PROCESSORS[name](tokenizer, {tokenizer.eos_token_id}, 1 << 40)
    params = SamplingParams(temperature=0, max_tokens=None, stop=STOP, ignore_eos=True)
    reqs = [Request(str(i), [1], params) for i in range(len(toks))]
    length = len(toks[0])
    first = length - steps
    if name == "FullRedecodeStopChecker":  # no state: start where the timing starts
        for req, ts in zip(reqs, toks, strict=True):
            req.output_token_ids = ts[:first]
            req.text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    else:
        for k in range(first):
            if k % 256 == 0:
                progress(f"{name} L={length}: untimed token {k}/{first}")
            for req, ts in zip(reqs, toks, strict=True):
                proc.append(req, ts[k], None, 0.0)
    times = []
    for k in range(first, length):
        progress(f"{name} L={length}: timed step {k - first + 1}/{steps}")
        t0 = time.process_time()
        for req, ts in zip(reqs, toks, strict=True):
            if proc.append(req, ts[k], None, 0.0) is not None:
                raise AssertionError(f"{name} stopped request {req.req_id} at {k}")
        times.append(time.process_time() - t0)
    want = tokenizer.decode(toks[-1], skip_special_tokens=True)
    if reqs[-1].text != want:
        raise AssertionError(f"{name}: the text differs from the full decode")
    return times


def plot(results: dict[tuple[str, int], float], lengths: list[int], path: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plotting import no_matplotlib, pyplot, save

    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    w = 0.38
    for j, name in enumerate(PROCESSORS):
        ys = [results[name, n] for n in lengths]
        xs = [i + (j - 0.5) * w for i in range(len(lengths))]
        ax.bar(xs, ys, w, label=name)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(lengths)), [f"{n:,} tokens" for n in lengths])
    ax.set_ylabel("ms per step (CPU time, log)")
    ax.set_title("Output processing, 64 requests, one token each per step", fontsize=10)
    ax.legend(fontsize=8)
    return save(plt, fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--steps", type=int, default=32, help="timed steps at the end (median)")
    ap.add_argument("--plot", type=Path, help="write a PNG of the table here (matplotlib)")
    args = ap.parse_args()

    from hisparse.models.smollm2 import smollm2_gguf_path
    from hisparse.models.tokenizer import GgufTokenizer

    progress("building SmolLM2's tokenizer")
    tokenizer = GgufTokenizer.from_gguf(smollm2_gguf_path())
    results: dict[tuple[str, int], float] = {}
    for n in args.lengths:
        toks = streams(tokenizer, args.requests, n)
        for name in PROCESSORS:
            times = measure(name, tokenizer, toks, min(args.steps, n))
            results[name, n] = statistics.median(times) * 1e3
    progress("")
    print(file=sys.stderr)
    lo, hi = min(args.lengths), max(args.lengths)
    print(f"{args.requests} requests, median of the last {args.steps} steps, process CPU time")
    print()
    cols = " | ".join(f"{n:,} tokens ms/step" for n in args.lengths)
    print(f"| processor | {cols} | {hi} / {lo} |")
    print("|---|" + "---|" * (len(args.lengths) + 1))
    for name in PROCESSORS:
        row = " | ".join(f"{results[name, n]:.3f}" for n in args.lengths)
        print(f"| {name} | {row} | {results[name, hi] / results[name, lo]:.2f} |")
    if args.plot:
        print(plot(results, args.lengths, args.plot))


if __name__ == "__main__":
    main()
