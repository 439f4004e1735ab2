"""The greedy sampler's argmax: ``torch.argmax(logits.float(), -1)`` (the copy to fp32 and
torch's reduction) beside `hisparse.engine.sampling_triton.argmax_rows` on the logits as the
model returns them, each checked equal first; µs a call, ten calls in one CUDA graph.

    PYTHONPATH=src python3 benchmarks/bench_argmax.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hisparse.engine.sampling_triton import argmax_rows
from hisparse.testing.cuda_graphs import graph_call_us


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    rows_l = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab in (4096, 49152, 129280):
        for rows in (1, 8, 29, 64, 256):
            x = torch.randn((rows, vocab), generator=g, device="cuda").to(torch.bfloat16)
            assert torch.equal(argmax_rows(x), torch.argmax(x.float(), dim=-1))
            torch_us = graph_call_us(lambda x=x: torch.argmax(x.float(), dim=-1))
            ours = graph_call_us(lambda x=x: argmax_rows(x))
            rows_l.append(dict(vocab=vocab, rows=rows, torch_us=torch_us, triton_us=ours))
    (out / "bench_argmax.json").write_text(json.dumps(rows_l, indent=1))
    print("| vocab | rows | torch µs | Triton µs | torch / Triton |")
    print("|---|---|---|---|---|")
    for r in rows_l:
        print(
            f"| {r['vocab']} | {r['rows']} | {r['torch_us']:.1f} | {r['triton_us']:.1f} | "
            f"{r['torch_us'] / r['triton_us']:.2f} |"
        )


if __name__ == "__main__":
    main()
