"""Plot two `profile_decode.py` runs against each other: the decode step's time per placement
and batch (torch compositions against the fused ops, say), with the roofline of the same run
as a marker and the ratio written above each pair.

    python benchmarks/plot_profile_decode.py reference/profile_decode.json \\
        triton/profile_decode.json --names "torch ops,fused ops" \\
        --out docs/img/decode_step_fused.png

Needs matplotlib (not a dependency of hisparse).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plotting import no_matplotlib, pyplot, ratio_bars, save


def rows(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """``(label, after ms, before ms, roofline ms)`` for every run both files hold."""
    key = lambda r: (r["placement"], r["path"], r["batch"])  # noqa: E731
    old = {key(r): r for r in before["results"] if "error" not in r}
    out = []
    for r in after["results"]:
        b = old.get(key(r))
        if "error" in r or b is None:
            continue
        label = f"{'all-GPU' if r['placement'] == 'gpu' else 'HiSparse'}\nbatch {r['batch']}"
        out.append((label, r["step_ms_median"], b["step_ms_median"], r.get("roofline_ms") or 0))
    return out


def plot(before: dict[str, Any], after: dict[str, Any], names: tuple[str, str], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    data = rows(before, after)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(data)), 4.2))
    labels = [d[0] for d in data]
    ratio_bars(ax, labels, [d[2] for d in data], [d[1] for d in data], names)
    xs = range(len(data))
    ax.scatter(list(xs), [d[3] for d in data], marker="_", s=900, color="black", zorder=3,
               label="roofline (same run)")  # fmt: skip
    ax.set_ylabel("decode step ms (median)")
    ax.set_title("Decode step at 128K, CUDA graphs: " + " vs ".join(names))
    ax.legend(fontsize=8)
    return save(plt, fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--names", default="before,after", help="the two runs' names, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("decode_step.png"))
    args = ap.parse_args()
    a, b = args.names.split(",")
    load = lambda p: json.loads(p.read_text())  # noqa: E731
    print(plot(load(args.before), load(args.after), (a, b), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
