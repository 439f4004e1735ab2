"""Validate `hisparse simulate` against `hisparse bench`: run the bench, then the simulator
on the same settings (`--compare`), and print predicted against measured last.

Issue #22's shape on one H200 (the defaults), everything written under ``--out``:

    PYTHONPATH=src python3 benchmarks/validate_simulate.py --out "$OUT"

It makes the v32-attention tiny model (4 layers; in the temporary folder, not under ``--out``:
it is 2 GB) unless ``--model`` names one, runs
``hisparse bench --json`` (both placements), then ``hisparse simulate --compare`` with
``--json`` and ``--plot``. Exit status: 0 when the running requests are within 5% and the
swapped bytes within 15%, 1 when not, other values when a step failed.

A CPU smoke run of the same path: ``--target cpu --preset tiny --input-len 200 --output-len 40
--concurrency 6 --gpu-memory-gib 0.001 --block-size 16 --max-batched-tokens 128``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(cmd: list[str], log: Path) -> int:
    """Run ``cmd`` with the repository's sources first on the path; its output goes to the
    terminal and to ``log``."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print("+", " ".join(cmd), flush=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        return proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "validate_out")))
    p.add_argument("--model", type=Path, help="a DSA checkpoint (default: make one)")
    p.add_argument("--preset", default="v32-attention", help="make-tiny preset")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--input-len", type=int, default=131072)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--concurrency", default="36")
    p.add_argument("--gpu-memory-gib", type=float, default=3.0)
    p.add_argument("--topk-overlap", default="0.8")
    p.add_argument("--kv-placement", default="hisparse,gpu")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    model = a.model
    if model is None:
        model = Path(tempfile.gettempdir()) / f"hisparse-validate-{a.preset}-{a.layers}"
        if not (model / "config.json").is_file():
            rc = _run([py, "-m", "hisparse", "make-tiny", "--arch", "deepseek_v32", "--preset",
                       a.preset, "--layers", str(a.layers), "--force", str(model)],
                      a.out / "make_tiny.log")  # fmt: skip
            if rc:
                return rc
    bench_json = a.out / "bench.json"
    bench = [py, "-m", "hisparse", "bench", "--model", str(model), "--input-len",
             str(a.input_len), "--output-len", str(a.output_len), "--concurrency", a.concurrency,
             "--gpu-memory-gib", str(a.gpu_memory_gib), "--topk-overlap", a.topk_overlap,
             "--prefill", "synthetic", "--kv-placement", a.kv_placement,
             "--json", str(bench_json)]  # fmt: skip
    if a.block_size is not None:
        bench += ["--block-size", str(a.block_size)]
    if a.max_batched_tokens is not None:
        bench += ["--max-batched-tokens", str(a.max_batched_tokens)]
    if a.target == "cpu":
        bench += ["--device", "cpu"]
    rc = _run(bench, a.out / "bench.log")
    if rc:
        return rc
    sim = [py, "-m", "hisparse", "simulate", "--compare", str(bench_json), "--target",
           a.target, "--json", str(a.out / "simulate.json"), "--plot",
           str(a.out / "simulate.png")]  # fmt: skip
    return _run(sim, a.out / "simulate.log")


if __name__ == "__main__":
    sys.exit(main())
