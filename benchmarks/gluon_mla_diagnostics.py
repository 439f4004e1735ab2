"""Diagnostic versions of the warp-specialised Gluon sparse MLA kernel: where its time goes.

Writes two module files next to each other, each the committed `sparse_mla_gluon` with one
part taken out, for `bench_sparse_mla.py --gluon --variants` to time beside the kept kernel
(their outputs are wrong by design; the bench's error column says so):

- ``gluon_consumers_only.py``: the row producer only signals each ring tile full (no loads,
  no dequantisation): the pace of the two dot warp groups alone;
- ``gluon_no_loads.py``: the producer dequantises and stores as usual, but every row load is
  masked off: its pace without the gathers' latency.

    python3 benchmarks/gluon_mla_diagnostics.py /tmp/diag
    PYTHONPATH=src python3 benchmarks/bench_sparse_mla.py --gluon --batches 29,64 --splits 2 \\
        --variants /tmp/diag/gluon_consumers_only.py,/tmp/diag/gluon_no_loads.py

The edits are text substitutions on the module's source; one that no longer matches fails
here, not silently (docs/benchmarks.md §9 has what they measured).
"""

from __future__ import annotations

import argparse
import os

from hisparse.attention import sparse_mla_gluon

#: The producer's loop body from its ring-tile stores to its next gather, and what replaces
#: it: a zero score bias and the "tile full" signal.
_STORES = """        kr_smem.index(b).store(rp)
        bias_smem.index(b).store(bias)
        kv.slice(0, 128, dim=1).store(_dequantise(k0, s0))
        kv.slice(128, 128, dim=1).store(_dequantise(k1, s1))
        kv.slice(256, 128, dim=1).store(_dequantise(k2, s2))
        kv.slice(384, 128, dim=1).store(_dequantise(k3, s3))
"""
_NEXT_GATHER = """        k0, k1, k2, k3, s0, s1, s2, s3, rp, bias = _gather(
            idx_next, ld, rc, lat_ptr, sc_ptr, rp_ptr, s_kv_b, s_kv_r, block_size, SC_OFF,
            RP_OFF)  # fmt: skip
"""
#: The gathers' masks, and masks no row passes (indices are >= -1, row offsets >= 0).
_MASKS = [
    ("    m2 = valid[:, None]\n", "    m2 = (idx < -1)[:, None]\n"),
    ("mask=valid, other=0.0)", "mask=idx < -1, other=0.0)"),
    ("mask=rvalid[:, None],", "mask=(rrow < 0)[:, None],"),
]


def _replace(src: str, old: str, new: str, count: int | None = None) -> str:
    found = src.count(old)
    if found == 0 or (count is not None and found != count):
        raise SystemExit(f"sparse_mla_gluon.py changed: {old.strip()[:60]!r} found {found}x")
    return src.replace(old, new)


def write_variants(out_dir: str) -> list[str]:
    """The two diagnostic module files under ``out_dir``; returns their paths."""
    with open(sparse_mla_gluon.__file__) as f:
        src = f.read()
    consumers = _replace(src, _STORES, "        bias_smem.index(b).store(gl.zeros_like(bias))\n", 1)
    consumers = _replace(consumers, _NEXT_GATHER, "", 1)
    no_loads = src
    for old, new in _MASKS:
        no_loads = _replace(no_loads, old, new)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in (("gluon_consumers_only", consumers), ("gluon_no_loads", no_loads)):
        path = os.path.join(out_dir, f"{name}.py")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    paths = write_variants(ap.parse_args().out_dir)
    print("--variants " + ",".join(paths))


if __name__ == "__main__":
    main()
