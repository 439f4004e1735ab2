"""Compiling a Gluon kernel for sm_90 on the CPU, for the Gluon kernels' CPU tests.

Gluon kernels do not run under Triton's CPU interpreter, so CI checks that each still compiles
for Hopper as a launch would build it. The compile runs in a process of its own without
``TRITON_INTERPRET`` (interpreted, `gluon.jit` functions are wrapped, and `gl.warp_specialize`
takes only real ones as partitions) and with a fresh Triton cache (a warm cache once hid a
compile that failed from a cold one, as CI has).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Dynamic shared memory one block may use on sm_90.
SM90_SMEM = 232448

#: The script's tail: compile ``fn`` (signature ``sig``, constants ``consts``, 16-divisible
#: arguments ``attrs``, ``options``) and write the PTX to argv[1].
_TAIL = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
try:
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs),
                       target=GPUTarget("cuda", 90, 128), options=options)
except RuntimeError as exc:  # a Triton build without the NVIDIA backend
    print("NO-SM90", exc)
    sys.exit(0)
open(sys.argv[1], "w").write(k.asm["ptx"])
print("SHARED", k.metadata.shared)
"""


def compile_sm90(script: str, tmp_path: Path) -> tuple[int, str, str]:
    """Run ``script`` (imports and ``fn``, ``sig``, ``consts``, ``attrs``, ``options``) and
    ptxas on its PTX: the kernel's shared memory, ptxas's report and the PTX. Skips where this
    Triton build cannot compile for sm_90."""
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    ptx = tmp_path / "k.ptx"
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + script + _TAIL, str(ptx)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    ).stdout
    if out.startswith("NO-SM90"):  # pragma: no cover
        pytest.skip(f"no sm_90 compiler here: {out}")
    shared = int(re.search(r"SHARED (\d+)", out).group(1))  # type: ignore[union-attr]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    if not os.path.exists(ptxas):  # pragma: no cover
        pytest.skip("no ptxas in this Triton build")
    res = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    return shared, res.stdout + res.stderr, ptx.read_text()


def spilled_bytes(info: str) -> int:
    """The most bytes ptxas reports any function spilling."""
    return max(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))
