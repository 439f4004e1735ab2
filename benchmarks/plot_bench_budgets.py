"""Plot `hisparse bench` runs made at different GPU KV budgets: per budget, HiSparse against
all-GPU in peak running requests and steady-state decode tok/s, the ratio above each pair.

    python benchmarks/plot_bench_budgets.py g15.json c36.json --out docs/img/bench_128k_budgets.png

Each JSON is one `hisparse bench --json` file (both placements, one concurrency). Needs
matplotlib (not a dependency of hisparse).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plotting import no_matplotlib, pyplot, ratio_bars, save


def pairs(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(label, hisparse result, all-GPU result)`` per file, in the order given."""
    out = []
    for run in runs:
        if len({r["concurrency"] for r in run["results"]}) != 1:
            raise SystemExit("one concurrency per JSON: this plot compares GPU budgets")
        by = {r["placement"]: r for r in run["results"]}
        if "hisparse" not in by or "gpu" not in by:
            raise SystemExit("each JSON must hold both placements (--kv-placement hisparse,gpu)")
        s, conc = run["settings"], by["gpu"]["concurrency"]
        label = f"{s['gpu_memory_gib']:g} GiB\n{s['input_len'] // 1024}K, x{conc}"
        out.append((label, by["hisparse"], by["gpu"]))
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    rows = pairs(runs)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.2 * len(rows), 4.2))
    panels = (("peak_running", "peak running requests"), ("peak_decode_tok_s", "decode tok/s"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        hs = [h[key] or 0 for _, h, _ in rows]  # None: no steady-state step
        gpu = [g[key] or 0 for _, _, g in rows]
        ratio_bars(ax, [r[0] for r in rows], hs, gpu, ("HiSparse", "all-GPU"))
        ax.set_title(title + (" (steady state)" if key == "peak_decode_tok_s" else ""))
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    return save(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, nargs="+", help="hisparse bench --json files")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    print(plot([json.loads(f.read_text()) for f in args.json], args.out))


if __name__ == "__main__":
    main()
