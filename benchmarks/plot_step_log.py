"""Plot a `hisparse bench --json` run's step log: every step's time (log scale; decode steps and
prefill-chunk steps apart) and the requests running or admitted, one panel per placement.

    python benchmarks/plot_step_log.py c36.json --out docs/img/c36_step_log.png

Shows where a whole run's time goes (a step that captures a graph or compiles kernels stands
out by orders of magnitude). Needs matplotlib (not a dependency of hisparse).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plotting import no_matplotlib, pyplot, save

NAMES = {"hisparse": "HiSparse", "gpu": "all-GPU"}


def plot(run: dict[str, Any], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    results = [r for r in run["results"] if r.get("step_log")]
    if not results:
        raise SystemExit("no step_log in this JSON (written by hisparse bench since session 4)")
    fig, axes = plt.subplots(
        len(results), 1, figsize=(9, 2.8 * len(results)), sharex=True, squeeze=False
    )
    for ax, r in zip(axes[:, 0], results, strict=True):
        log = r["step_log"]
        for kind, marker, label in ((1, "o", "decode step"), (0, "x", "prefill chunk")):
            pts = [(i, ms) for i, (d, _n, ms) in enumerate(log) if d == kind]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=6, marker=marker, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("step ms")
        ax.set_title(
            f"{NAMES.get(r['placement'], r['placement'])} x{r['concurrency']}: "
            f"{len(log)} steps, decode steps {r['decode_seconds']:.2f} s",
            fontsize=10,
        )
        twin = ax.twinx()
        twin.plot(range(len(log)), [n for _d, n, _ms in log], color="grey", lw=0.8)
        twin.set_ylabel("running / admitted", color="grey")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    s = run["settings"]
    fig.suptitle(
        f"hisparse bench step log: {s['input_len'] // 1024}K prompts, "
        f"{s['gpu_memory_gib']:g} GiB KV budget",
        fontsize=11,
    )
    return save(plt, fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(plot(json.loads(args.json.read_text()), args.out))


if __name__ == "__main__":
    main()
