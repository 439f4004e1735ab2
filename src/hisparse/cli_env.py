"""What the ``hisparse`` command sets in its own environment before torch loads (`hisparse.cli`
imports this module before anything that imports torch).

``OMP_WAIT_POLICY=PASSIVE``, unless the shell sets it: after each parallel op, OpenMP's idle
workers (torch's, which numba's prefill kernels share) otherwise spin for a while before they
sleep, and on a machine whose cores also run other work the spinning takes the cores from the
threads doing the work: a long CPU prefill ran several times slower (docs/benchmarks.md §25).
OpenMP reads the variable once, when torch loads: a Python API user sets it in the shell
(README, "CPU").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
