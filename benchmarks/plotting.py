"""Shared bits of the benchmark plots: matplotlib on demand, paired bars with their ratio.

matplotlib is not a dependency of hisparse; every plot says so instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` with the Agg backend, or ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def no_matplotlib(path: Path) -> str:
    """What a plot function returns instead of a plot when matplotlib is missing."""
    return f"no plot: matplotlib is not installed; skipped {path}"


def ratio_bars(
    ax: Any,
    labels: list[str],
    ours: list[float],
    theirs: list[float],
    names: tuple[str, str],
    fontsize: int = 9,
) -> None:
    """One bar pair per label, ``ours / theirs`` written above each pair."""
    xs = range(len(labels))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], ours, w, label=names[0])
    ax.bar([x + w / 2 for x in xs], theirs, w, label=names[1])
    for x, a, b in zip(xs, ours, theirs, strict=True):
        if b:  # a missing value (0) gets no ratio
            ax.annotate(f"{a / b:.2f}×", (x, max(a, b)), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), labels, fontsize=fontsize)


def save(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
