"""Request traces: arrival time and prompt / output lengths, synthetic or from a JSONL file.

A JSONL line is ``{"arrival": seconds, "input_len": tokens, "output_len": tokens}``
(``prompt_len`` / ``output_tokens`` are accepted too). Synthetic traces draw Poisson
arrivals (exponential gaps at ``rate`` per second; ``rate`` 0: everything at t = 0) and
fixed or lognormal lengths (the given length is the median).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    input_len: int
    output_len: int


def synthetic_trace(
    n: int,
    *,
    input_len: int,
    output_len: int,
    rate: float = 0.0,
    input_sigma: float = 0.0,
    output_sigma: float = 0.0,
    max_len: int | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """``n`` requests; lengths lognormal around the given medians (sigma 0: fixed), capped
    so prompt + output fit ``max_len``."""
    if n < 1 or input_len < 1 or output_len < 1 or rate < 0:
        raise ValueError("synthetic trace: n, lengths >= 1 and rate >= 0")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n) if rate > 0 else np.zeros(n)
    arrival = np.cumsum(gaps) - gaps[0]

    def lengths(median: int, sigma: float) -> np.ndarray:
        if sigma <= 0:
            return np.full(n, median, dtype=np.int64)
        return np.maximum(np.rint(rng.lognormal(np.log(median), sigma, n)), 1).astype(np.int64)

    ins, outs = lengths(input_len, input_sigma), lengths(output_len, output_sigma)
    if max_len is not None:
        ins = np.minimum(ins, max_len - 1)
        outs = np.minimum(outs, max_len - ins)
    return [
        TraceRequest(float(a), int(i), int(o)) for a, i, o in zip(arrival, ins, outs, strict=True)
    ]


def load_trace(path: Path) -> list[TraceRequest]:
    """A JSONL trace, sorted by arrival."""
    out = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            req = TraceRequest(
                float(d.get("arrival", 0.0)),
                int(d["input_len"] if "input_len" in d else d["prompt_len"]),
                int(d["output_len"] if "output_len" in d else d["output_tokens"]),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{k}: not a trace line ({err}): {line[:80]!r}") from None
        if req.input_len < 1 or req.output_len < 1 or req.arrival < 0:
            raise ValueError(f"{path}:{k}: lengths must be >= 1 and arrival >= 0")
        out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival)
