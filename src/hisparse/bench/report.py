"""The report of ``hisparse bench``: the results table, the HiSparse / all-GPU ratios per
concurrency and the PNG plot (also redrawn from saved JSON). Split from the command
(`hisparse.bench.cli`) so that what a run prints and draws reads on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

PLACEMENT_NAMES = {"hisparse": "HiSparse", "gpu": "all-GPU"}


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def results_table(results: list[dict[str, Any]], synthetic: bool) -> Table:
    title = "Decode benchmark" + (" (TTFT not measured: synthetic prefill)" if synthetic else "")
    t = Table(title=title, title_justify="left")
    cols = [
        "placement",
        "conc.",
        "done",
        "peak held",
        "peak running",
        "decode tok/s",
        "tok/s at peak",
        "step p50/p95 ms",
        "TTFT p50/p95 s",
        "TPOT p50/p95 ms",
        "hit rate",
        "swapped GB",
        "H2D GB/s",
        "resolve/gather ms",
    ]
    if not synthetic:
        cols += ["prefill tok/s", "prefill TFLOP/s (GEMM)", "MFU"]
    spec = any("spec_drafted" in r for r in results)
    if spec:
        cols += ["drafts accepted", "mean accepted length"]
    for c in cols:
        t.add_column(c, justify="left" if c == "placement" else "right")
    for r in results:
        ttft = "n/a" if synthetic else f"{_fmt(r['ttft_p50'], 1, 2)}/{_fmt(r['ttft_p95'], 1, 2)}"
        timing = (
            f"{r['resolve_ms_per_step']:.2f}/{r['gather_ms_per_step']:.2f}"
            if "resolve_ms_per_step" in r
            else "-"
        )
        prefill = (
            []
            if synthetic
            else [
                _fmt(r.get("prefill_tok_s"), 1, 0),
                f"{_fmt(r.get('prefill_tflop_s'))} ({_fmt(r.get('gemm_tflop_s'))})",
                "-" if r.get("prefill_mfu") is None else f"{100 * r['prefill_mfu']:.0f}%",
            ]
        )
        label = PLACEMENT_NAMES[r["placement"]]
        if r.get("offload") == "always":
            label += " (offload always)"
        elif r.get("offload") == "under_pressure":
            label += f" ({r.get('demotions', 0)} demoted)"
        t.add_row(
            label,
            str(r["concurrency"]),
            f"{r['completed']}/{r['requests']}",
            str(r.get("peak_admitted", "-")),
            str(r["peak_running"]),
            _fmt(r["decode_tok_s"]),
            _fmt(r.get("peak_decode_tok_s")),
            f"{_fmt(r['decode_step_ms_p50'], 1, 1)}/{_fmt(r['decode_step_ms_p95'], 1, 1)}",
            ttft,
            f"{_fmt(r['tpot_p50'], 1e3, 2)}/{_fmt(r['tpot_p95'], 1e3, 2)}",
            "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%",
            f"{r['bytes_swapped'] / 1e9:.3f}",
            f"{r['h2d_gb_s']:.2f}",
            timing,
            *prefill,
            *(
                [
                    f"{r.get('spec_accepted', 0)}/{r.get('spec_drafted', 0)}",
                    _fmt(r.get("mean_accepted_length"), 1, 2),
                ]
                if spec
                else []
            ),
        )
    return t


def ratio_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """HiSparse / all-GPU per concurrency (where both ran)."""
    by = {(r["placement"], r["concurrency"]): r for r in results}
    out = []
    for (p, n), hs in sorted(by.items(), key=lambda kv: kv[0][1]):
        gpu = by.get(("gpu", n))
        if p != "hisparse" or gpu is None:
            continue

        def ratio(key: str, hs: dict = hs, gpu: dict = gpu) -> float | None:
            a, b = hs.get(key), gpu.get(key)
            return None if a is None or not b else a / b

        out.append(
            dict(
                concurrency=n,
                peak_running=ratio("peak_running"),
                decode_tok_s=ratio("decode_tok_s"),
                peak_decode_tok_s=ratio("peak_decode_tok_s"),
                tpot_p50=ratio("tpot_p50"),
                tpot_p95=ratio("tpot_p95"),
                # comparable only under the same schedule (every step's batch): other batch
                # sizes may round differently (bf16 GEMMs), which is not a placement difference
                same_tokens=hs["token_ids"] == gpu["token_ids"]
                if hs.get("schedule") == gpu.get("schedule")
                else None,
            )
        )
    return out


def ratio_table(ratios: list[dict[str, Any]]) -> Table:
    t = Table(title="HiSparse / all-GPU", title_justify="left")
    cols = ("conc.", "peak running", "decode tok/s", "tok/s at peak", "TPOT p50", "TPOT p95")
    for c in (*cols, "same tokens"):
        t.add_column(c, justify="right")
    for r in ratios:
        t.add_row(
            str(r["concurrency"]),
            *(
                _fmt(r[k], 1, 2) + "x" if r[k] is not None else "-"
                for k in (
                    "peak_running",
                    "decode_tok_s",
                    "peak_decode_tok_s",
                    "tpot_p50",
                    "tpot_p95",
                )
            ),
            {True: "yes", False: "NO"}.get(r["same_tokens"], "n/a (other batches)"),
        )
    return t


def write_plot(results: list[dict[str, Any]], path: Path) -> str:
    """PNG against concurrency per placement: decode tok/s (steady state solid, whole run
    dashed), decode step p50 and peak running requests."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); skipped {path}"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for placement in PLACEMENT_NAMES:
        rows = sorted(
            (r for r in results if r["placement"] == placement), key=lambda r: r["concurrency"]
        )
        if not rows:
            continue
        x = [r["concurrency"] for r in rows]
        label = PLACEMENT_NAMES[placement]
        line = axes[0].plot(
            x, [r.get("peak_decode_tok_s") or 0 for r in rows], marker="o", label=label
        )[0]
        axes[0].plot(
            x, [r["decode_tok_s"] for r in rows], ls="--", color=line.get_color(),
            label=f"{label}, whole run",
        )  # fmt: skip
        axes[1].plot(x, [r["decode_step_ms_p50"] or 0 for r in rows], marker="o", label=label)
        axes[2].plot(x, [r["peak_running"] for r in rows], marker="o", label=label)
    titles = ("decode tok/s (steady state)", "decode step p50 (ms)", "peak running requests")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests submitted)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def plot_from(json_paths: list[Path], path: Path) -> str:
    """Redraw the plot from the JSON of one or more runs (e.g. one run per concurrency)."""
    results = [r for p in json_paths for r in json.loads(p.read_text())["results"]]
    return write_plot(results, path)
