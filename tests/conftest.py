"""Shared test setup."""

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI stays reproducible: a failure seen
# once is seen again); HISPARSE_HYPOTHESIS=explore draws fresh ones, for hunting.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("HISPARSE_HYPOTHESIS") == "explore" else "fixed")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: on a busy 2-core CI machine spinning OpenMP workers made each small
    matmul far slower than running it on one core."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# The suite's lossless and swap-path tests read through the hot buffers even where the GPU
# pool has room: `HiSparseConfig.offload` unset means "always" here (the library's default,
# "under_pressure", keeps such requests resident). Tests of the default unset the variable.
os.environ.setdefault("HISPARSE_OFFLOAD", "always")
