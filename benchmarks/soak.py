"""Soak: `hisparse serve` in its own process under a mixed load for minutes to hours.

Starts ``python -m hisparse serve --port 0`` on 127.0.0.1 with the given flags (or attaches
to ``--url``), then runs `hisparse.serve.soak.MixedLoad` (short chats, ``n=2``, streams, long
prompts, streams that hang up after two chunks, non-streamed clients that give up, malformed
JSON, ``max_tokens: -1``, over-long prompts, ``n: 1000000``) for ``--minutes``. Every
``--window`` seconds it prints the requests by outcome, the latency percentiles of the
requests that generated, and the server's resident memory; at the end the requests by kind
and status, whether the server drained (nothing running or waiting, no pool block in use),
and how fast it stopped on SIGTERM. ``--out`` writes it all as JSON, ``--plot`` a PNG.

    python benchmarks/soak.py --minutes 10 --plot docs/img/soak_smollm2_cpu.png
    python benchmarks/soak.py --minutes 60 -- --max-num-seqs 16 --gpu-memory-gib 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from hisparse.serve.soak import EXPECTED, MixedLoad, Outcome, rss_mib, summary
from plotting import no_matplotlib, pyplot, save

#: kinds whose 200 carries generated tokens (their latency is reported)
GENERATING = ("chat", "chat_n2", "stream", "long_prompt")


def _pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def _class(o: Outcome) -> str:
    if o.status >= 500:
        return "5xx"
    if not o.expected:
        return "unexpected"
    if o.status == -1 or o.kind.endswith("hangup"):
        return "hung up"
    return "ok" if o.status == 200 else "4xx (refused)"


CLASSES = ("ok", "4xx (refused)", "hung up", "unexpected", "5xx")


def _start(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hisparse", "serve", "--model", args.model, "--port", "0",
           "--host", "127.0.0.1", "--device", args.device, "--offload", args.offload,
           "--max-waiting", str(args.max_waiting), "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the server prints the port it bound, after the load
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
            # whatever it prints later is read, so that a full pipe never blocks it
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"the server exited ({proc.wait()}) before it served")


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("hisparse:") and " " in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _window_rows(outcomes: list[Outcome], t0: float, window: float, end: float) -> list[dict]:
    rows = []
    for k in range(int((end - t0) // window + 0.999)):
        lo, hi = t0 + k * window, t0 + (k + 1) * window
        part = [o for o in outcomes if lo <= o.end < hi]
        lat = [o.latency for o in part if o.kind in GENERATING and o.status == 200]
        counts = {c: sum(_class(o) == c for o in part) for c in CLASSES}
        rows.append(dict(t=hi - t0, n=len(part), **counts, p50=_pct(lat, 0.5),
                         p95=_pct(lat, 0.95), p99=_pct(lat, 0.99)))  # fmt: skip
    return rows


def _plot(
    path: Path, rows: list[dict], rss: list[tuple[float, float]], window: float, title: str
) -> str:
    plt = pyplot()
    if plt is None:
        return no_matplotlib(path)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    starts = [(r["t"] - window) / 60 for r in rows]
    t = [s + window / 120 for s in starts]  # the middle of each window
    bottom = [0.0] * len(rows)
    for c in CLASSES:
        ys = [r[c] for r in rows]
        if any(ys):
            axes[0].bar(starts, ys, width=0.9 * window / 60, bottom=bottom, label=c,
                        align="edge")  # fmt: skip
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    axes[0].set_ylabel("requests / window")
    axes[0].legend(fontsize=8, ncol=len(CLASSES))
    for q in ("p50", "p95", "p99"):
        axes[1].plot(t, [r[q] for r in rows], marker=".", label=q)
    axes[1].set_ylabel("latency of generating\nrequests (s)")
    axes[1].legend(fontsize=8)
    axes[2].plot([x / 60 for x, _ in rss], [y for _, y in rss])
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].set_xlabel("minutes")
    axes[0].set_title(title, fontsize=10)
    return save(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--offload", default="always")
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192, help="the server's")
    p.add_argument("--url", default=None, help="attach to this server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="its process, for RSS (with --url)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--long-chars", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--window", type=float, default=60.0, help="seconds per reported window")
    p.add_argument("--rss-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    console = Console()
    proc = None
    if args.url is None:
        proc, url = _start(args, ["--max-model-len", str(args.max_model_len), *extra])
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    console.print(f"soaking {url} for {args.minutes:g} min with {args.clients} clients")
    load = MixedLoad(
        url, model=args.model, seconds=args.minutes * 60, max_model_len=args.max_model_len,
        clients=args.clients, long_chars=args.long_chars, max_tokens=args.max_tokens,
        seed=args.seed,
    )  # fmt: skip
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    done = threading.Event()

    def watch() -> None:
        next_report = t0 + args.window
        while not done.wait(args.rss_every):
            now = time.monotonic()
            if pid is not None and os.path.exists(f"/proc/{pid}"):
                rss.append((now - t0, rss_mib(pid)))
            if now >= next_report:
                (row,) = _window_rows(list(load.outcomes), now - args.window, args.window, now)
                console.print(
                    f"{(now - t0) / 60:6.1f} min  {row['n']:4d} requests  ok {row['ok']}  "
                    f"refused {row['4xx (refused)']}  hung up {row['hung up']}  "
                    f"unexpected {row['unexpected']}  5xx {row['5xx']}  latency p50 "
                    f"{row['p50']:.2f} p95 {row['p95']:.2f} p99 {row['p99']:.2f} s  RSS "
                    f"{rss[-1][1] if rss else float('nan'):.0f} MiB",
                    soft_wrap=True,
                )
                next_report += args.window

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcomes = load.run()
    end = time.monotonic()
    drain_s = None
    for _ in range(600):  # what the server still holds once every client is done
        m = _metrics(url)
        if m["hisparse:num_requests_running"] == 0 == m["hisparse:num_requests_waiting"]:
            drain_s = time.monotonic() - end
            break
        time.sleep(0.1)
    done.set()
    watcher.join()
    m = _metrics(url)
    stop_s, code = None, None
    if proc is not None:
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stop_s = time.monotonic() - t

    table = Table(title=f"{len(outcomes)} requests in {(end - t0) / 60:.1f} min")
    table.add_column("kind")
    table.add_column("expected")
    table.add_column("outcomes (status: count; -1 hung up)")
    for kind, counts in sorted(summary(outcomes).items()):
        table.add_row(kind, str(sorted(EXPECTED[kind])),
                      ", ".join(f"{s}: {n}" for s, n in sorted(counts.items())))  # fmt: skip
    console.print(table)
    rows = _window_rows(outcomes, t0, args.window, end)
    lat = [o.latency for o in outcomes if o.kind in GENERATING and o.status == 200]
    result = dict(
        minutes=args.minutes, clients=args.clients, requests=len(outcomes),
        by_class={c: sum(_class(o) == c for o in outcomes) for c in CLASSES},
        by_kind={k: dict(v) for k, v in summary(outcomes).items()},
        latency=dict(p50=_pct(lat, 0.5), p95=_pct(lat, 0.95), p99=_pct(lat, 0.99)),
        windows=rows, rss=rss, drained_s=drain_s, stop_s=stop_s, exit_code=code,
        pool_blocks_used=dict(gpu=m.get("hisparse:gpu_pool_blocks_used"),
                              host=m.get("hisparse:host_pool_blocks_used")),
        aborted=m.get("hisparse:request_aborted_total"),
    )  # fmt: skip
    drained = f"in {drain_s:.1f} s" if drain_s is not None else "NOT"
    console.print(
        f"by outcome {result['by_class']}; generating requests' latency p50 "
        f"{result['latency']['p50']:.2f} p95 {result['latency']['p95']:.2f} p99 "
        f"{result['latency']['p99']:.2f} s; drained {drained}; pool blocks in use "
        f"{result['pool_blocks_used']}; aborts {result['aborted']:.0f}"
        + (f"; RSS {rss[0][1]:.0f} -> {rss[-1][1]:.0f} MiB (max {max(r for _, r in rss):.0f})"
           if rss else "")
        + (f"; SIGTERM -> exit {code} in {stop_s:.1f} s" if stop_s is not None else ""),
        soft_wrap=True,
    )  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        title = (f"hisparse serve soak: {args.model} ({args.device}, offload={args.offload}), "
                 f"{args.clients} clients, {args.minutes:g} min")  # fmt: skip
        console.print(_plot(args.plot, rows, rss, args.window, title))


if __name__ == "__main__":
    main()
