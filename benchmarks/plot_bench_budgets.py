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


def pairs(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(label, hisparse result, all-GPU result)`` per file, in the order given."""
    out = []
    for run in runs:
        by = {r["placement"]: r for r in run["results"]}
        if "hisparse" not in by or "gpu" not in by:
            raise SystemExit("each JSON must hold both placements (--kv-placement hisparse,gpu)")
        s, conc = run["settings"], by["gpu"]["concurrency"]
        label = f"{s['gpu_memory_gib']:g} GiB\n{s['input_len'] // 1024}K, x{conc}"
        out.append((label, by["hisparse"], by["gpu"]))
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed; skipped {path}"
    rows = pairs(runs)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.2 * len(rows), 4.2))
    panels = (("peak_running", "peak running requests"), ("peak_decode_tok_s", "decode tok/s"))
    w = 0.38
    for ax, (key, title) in zip(axes, panels, strict=True):
        xs = range(len(rows))
        hs = [h[key] for _, h, _ in rows]
        gp = [g[key] for _, _, g in rows]
        ax.bar([x - w / 2 for x in xs], hs, w, label="HiSparse")
        ax.bar([x + w / 2 for x in xs], gp, w, label="all-GPU")
        for x, a, b in zip(xs, hs, gp, strict=True):
            ax.annotate(f"{a / b:.2f}×", (x, max(a, b)), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(xs), [r[0] for r in rows])
        ax.set_title(title + (" (steady state)" if key == "peak_decode_tok_s" else ""))
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, nargs="+", help="hisparse bench --json files")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    print(plot([json.loads(f.read_text()) for f in args.json], args.out))


if __name__ == "__main__":
    main()
