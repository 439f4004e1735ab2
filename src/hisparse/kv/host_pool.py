"""The process's single pinned host backing that holds every sparse layer's KV rows.

On CUDA the backing is ordinary host memory registered with ``cudaHostRegister`` for exactly
its size (portable + mapped), so the GPU reads it directly over PCIe (UVA zero-copy) and the
registration is released deterministically by `HostPool.close`, not by the garbage collector.
A CPU run gets plain memory: the reference ops read it the same way.

The process-wide slot that enforces "one pool" holds the live pool by weak reference: a pool
nobody holds any more (its `LLM` dropped without ``close()``) is released by its finalizer
(`HostPool.__del__`), and a new pool first collects such garbage once before refusing, so a
dropped engine never blocks the next one, and two registrations never coexist.

Tensor parallelism shares one backing among a node's ranks (docs/design.md §18): the pool is
then a shared mapping of a file in ``/dev/shm`` (`SharedBacking`), created and filled with
pages once by local rank 0 and mapped by every local rank; each process registers its own
mapping with CUDA. `hisparse.parallel.shm` orders the creation, the mappings and the unlink.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from hisparse.validation import HiSparseConfigError

#: Refuse a host pool above this fraction of the memory currently available.
MAX_AVAILABLE_FRACTION = 0.95
_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_MAPPED = 0x02

#: Reentrant: a pool's finalizer (``close``) may run from a collection inside the lock.
_live_lock = threading.RLock()
_live_ref: weakref.ref[HostPool] | None = None


class HostPoolError(RuntimeError):
    """The host pool cannot be created as configured; the message says what to change."""


class HostPoolSizeError(HiSparseConfigError, HostPoolError):
    """A host pool larger than the memory available (also a ValueError: a setting to change)."""


def live_pool() -> HostPool | None:
    """The process's open host pool, if any."""
    pool = _live_ref() if _live_ref is not None else None
    return pool if pool is not None and pool._backing is not None else None


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(size: int, available: int | None = None) -> None:
    available = available_host_bytes() if available is None else available
    limit = int(available * MAX_AVAILABLE_FRACTION)
    if size > limit:
        raise HostPoolSizeError(
            f"HiSparse host pool of {size / 2**30:.2f} GiB exceeds 95% of the "
            f"{available / 2**30:.2f} GiB of host memory available; set host_pool_gib <= "
            f"{limit / 2**30:.2f}.",
            field="HiSparseConfig.host_pool_gib",
            value=size / 2**30,
        )


@dataclass(frozen=True)
class SharedBacking:
    """A host pool backed by the shared mapping of ``path`` (a file in ``/dev/shm``).

    ``create``: this process makes the file (``size`` bytes, every page allocated up front, so a
    full ``/dev/shm`` fails here and not as a SIGBUS later); otherwise it maps the file another
    process made. The file's name may be unlinked once every process has mapped it."""

    path: str
    create: bool


def create_shared_file(path: str, size: int) -> None:
    """Make ``path`` (exclusive, mode 0600) of ``size`` bytes, all of them allocated."""
    directory = os.path.dirname(path) or "."
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise HostPoolSizeError(
            f"the shared HiSparse host pool of {size / 2**30:.2f} GiB does not fit the "
            f"{free / 2**30:.2f} GiB free in {directory} (a tmpfs: containers need a larger "
            f"--shm-size); set host_pool_gib <= {0.95 * free / 2**30:.2f} or enlarge {directory}.",
            field="HiSparseConfig.host_pool_gib",
            value=size / 2**30,
        )
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        os.unlink(path)
        raise HostPoolError(f"cannot allocate {size} bytes for {path}: {err}") from err
    os.close(fd)


class HostPool:
    """One pinned (CUDA) or plain (CPU) host backing of ``size`` bytes, one per process.

    ``shared``: map a file shared with the other ranks of a node instead of allocating private
    memory (`SharedBacking`); ``created`` and ``inode`` then say which process made it and
    which file every process maps (what the tensor-parallel tests check)."""

    def __init__(
        self, size: int, *, pin: bool | None = None, shared: SharedBacking | None = None
    ) -> None:
        global _live_ref
        self._backing: torch.Tensor | None = None
        self._registered = False
        if size <= 0:
            raise HostPoolError(f"HiSparse host pool size must be positive, got {size} bytes.")
        self.size = size
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.shared = shared
        self.created = shared is None or shared.create
        self.inode: int | None = None
        if self.pinned and not torch.cuda.is_available():
            raise HostPoolError("a pinned host pool needs CUDA; use pin=False on a CPU run.")
        if live_pool() is not None:
            # a pool only garbage holds (an engine dropped inside a reference cycle) is
            # released by the collection; a pool something still holds stays and is refused
            gc.collect()
        if self.created:
            # a rank that maps a pool another made allocates nothing (and the pool it maps
            # already counts against the memory available)
            check_host_memory(size)
        with _live_lock:
            if live_pool() is not None:
                raise HostPoolError(
                    "a HiSparse host pool already exists in this process; close() it first "
                    "(one pinned backing per process keeps registration exact and bounded)."
                )
            if shared is None:
                self._backing = torch.empty(size, dtype=torch.uint8)
            else:
                if shared.create:
                    create_shared_file(shared.path, size)
                if os.path.getsize(shared.path) != size:
                    raise HostPoolError(
                        f"{shared.path} holds {os.path.getsize(shared.path)} bytes, not the "
                        f"{size} this rank's layout needs: the ranks disagree on the pool size."
                    )
                self.inode = os.stat(shared.path).st_ino
                self._backing = torch.from_file(
                    shared.path, shared=True, size=size, dtype=torch.uint8
                )
            if self.pinned:
                err = torch.cuda.cudart().cudaHostRegister(
                    self._backing.data_ptr(),
                    size,
                    _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED,
                )
                if int(err) != 0:
                    self._backing = None
                    raise HostPoolError(f"cudaHostRegister of {size} bytes failed: {err}.")
                self._registered = True
            _live_ref = weakref.ref(self)

    @property
    def backing(self) -> torch.Tensor:
        if self._backing is None:
            raise HostPoolError("the HiSparse host pool was closed.")
        return self._backing

    def close(self) -> None:
        """Unregister and drop the backing now (idempotent)."""
        global _live_ref
        with _live_lock:
            if getattr(self, "_backing", None) is None:
                return
            if self._registered:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self._backing.data_ptr())
                self._registered = False
            self._backing = None
            if _live_ref is not None and _live_ref() in (self, None):
                _live_ref = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # not contextlib.suppress: at interpreter exit the module's globals may be gone
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass


def is_host_pool_memory(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` views this process's registered host pool (or torch-pinned memory).

    torch's ``is_pinned`` may not recognise ranges registered with ``cudaHostRegister``; the
    pool knows its own range.
    """
    pool = live_pool()
    if pool is not None and pool._backing is not None and pool._registered:
        start = pool._backing.data_ptr()
        ptr = tensor.untyped_storage().data_ptr()
        if start <= ptr < start + pool.size:
            return True
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False
