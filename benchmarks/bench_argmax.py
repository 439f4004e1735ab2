"""The greedy sampler's argmax: ``torch.argmax(logits.float(), -1)`` (the copy to fp32 and
torch's reduction) beside `hisparse.engine.sampling_triton.argmax_rows` on the logits as the
model returns them, each checked equal first; µs a call, ten calls in one CUDA graph.

    PYTHONPATH=src python3 benchmarks/bench_argmax.py            # GPU: writes bench_argmax.json
    python benchmarks/bench_argmax.py --plot bench_argmax.json --out docs/img/argmax.png
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def measure(out: Path) -> None:
    import torch

    from hisparse.engine.sampling_triton import argmax_rows
    from hisparse.testing.cuda_graphs import graph_call_us

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
        print(f"| {r['vocab']} | {r['rows']} | {r['torch_us']:.1f} | {r['triton_us']:.1f} | "
              f"{r['torch_us'] / r['triton_us']:.2f} |")  # fmt: skip


def plot(src: Path, out: Path) -> str:
    from plotting import no_matplotlib, pyplot, ratio_bars, save

    plt = pyplot()
    if plt is None:
        return no_matplotlib(out)
    rows_l = json.loads(src.read_text())
    vocabs = sorted({r["vocab"] for r in rows_l})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(4 * len(vocabs), 3.4))
    for ax, v in zip(axes, vocabs, strict=True):
        rs = [r for r in rows_l if r["vocab"] == v]
        ratio_bars(ax, [str(r["rows"]) for r in rs], [r["torch_us"] for r in rs],
                   [r["triton_us"] for r in rs], ("torch", "Triton"))  # fmt: skip
        ax.set_title(f"vocabulary {v:,}", fontsize=10)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("µs a call (H200)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Greedy argmax: torch.argmax(logits.float()) vs the Triton kernel", fontsize=11)
    return save(plt, fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", type=Path, help="plot this JSON instead of measuring")
    ap.add_argument("--out", type=Path, default=Path("argmax.png"))
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot, args.out))
    else:
        measure(Path(os.environ.get("OUT", ".")))


if __name__ == "__main__":
    main()
