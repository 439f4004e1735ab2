"""Plot `bench_smollm2.py` results: decode tokens/s of our engine against transformers'
``generate``, one bar pair per device, batch and top_k, the ratio written above each pair.

    python benchmarks/plot_smollm2.py cpu/bench_smollm2.json h200/bench_smollm2.json \\
        --out docs/img/smollm2_vs_transformers.png

Needs matplotlib (not a dependency of hisparse; `bench_smollm2.py` calls `plot` when it is
installed and skips the plot otherwise).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plotting import no_matplotlib, pyplot, ratio_bars, save


def bars(results: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """``(label, ours, transformers)`` decode tok/s for every run of every result file."""
    rows = []
    for res in results:
        meta = res["meta"]
        dev = "CPU fp32" if meta["device"] == "cpu" else f"{meta['device'].upper()} bf16"
        for run in res["runs"]:
            k = "dense" if run.get("dense") else f"top_k {run['top_k']}"
            label = f"{dev}\nbatch {run['batch']}\n{k}"
            rows.append((label, run["ours"]["decode_tok_s"], run["transformers"]["decode_tok_s"]))
    return rows


def plot(results: list[dict[str, Any]], path: Path) -> str:
    """Write the PNG; returns a line saying what was written (or why not)."""
    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    rows = bars(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 4.2))
    ratio_bars(
        ax, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
        ("hisparse (KV in the host pool)", "transformers generate"), fontsize=8,
    )  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_title("SmolLM2-135M, same GGUF file: decode throughput")
    ax.legend(fontsize=8, loc="upper left")
    return save(plt, fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", type=Path, help="bench_smollm2.json files")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    print(plot([json.loads(p.read_text()) for p in args.json], args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
