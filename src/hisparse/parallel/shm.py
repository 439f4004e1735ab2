"""One host pool per node, shared by the node's ranks (docs/design.md §18).

Local rank 0 creates ``/dev/shm/<engine>-pool`` at the pool's size with every page allocated;
every local rank then maps it (`HostPool` with a `SharedBacking`, registered with CUDA in each
process) and, once all have, local rank 0 unlinks the name: the memory lives exactly as long as
some rank maps it, so no file is left behind whichever process dies later. Host memory is the
one-rank pool's whatever the rank count.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hisparse.kv.host_pool import HostPool, SharedBacking

#: Where the node's pool file lives while the ranks map it (a tmpfs).
SHM_DIR = "/dev/shm"


def pool_path(tp: Any) -> str:
    return os.path.join(SHM_DIR, f"{tp.pool_name}-pool")


def shared_host_pool(size: int, pin: bool, tp: Any) -> HostPool:
    """The node's host pool as this rank maps it. Collective: every rank calls it in order."""
    path = pool_path(tp)
    creator = tp.local_rank == 0
    pool: HostPool | None = None
    error: BaseException | None = None
    if creator:
        try:
            pool = HostPool(size, pin=pin, shared=SharedBacking(path, create=True))
        except BaseException as err:  # the others must not wait for a file that never comes
            error = err
    ok = tp.agree_min(0.0 if error is not None else 1.0)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError(f"local rank 0 could not create the shared host pool {path}")
    try:
        if not creator:
            pool = HostPool(size, pin=pin, shared=SharedBacking(path, create=False))
    except BaseException as err:
        error = err
    ok = tp.agree_min(0.0 if error is not None else 1.0)
    if creator:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # every local rank maps it (or gave up): the name can go
    if error is not None:
        raise error
    if not ok:
        if pool is not None:
            pool.close()
        raise RuntimeError(f"a rank could not map the shared host pool {path}")
    assert pool is not None
    return pool


def unlink_pool_file(tp: Any) -> None:
    """Remove the pool's name if start-up failed between creating and unlinking it."""
    if tp.pool_name and tp.local_rank == 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pool_path(tp))
