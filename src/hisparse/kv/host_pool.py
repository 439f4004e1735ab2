"""The process's single pinned host backing that holds every sparse layer's KV rows.

On CUDA the backing is ordinary host memory registered with ``cudaHostRegister`` for exactly
its size (portable + mapped), so the GPU reads it directly over PCIe (UVA zero-copy) and the
registration is released deterministically by `HostPool.close`, not by the garbage collector.
A CPU run gets plain memory: the reference ops read it the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

#: Refuse a host pool above this fraction of the memory currently available.
MAX_AVAILABLE_FRACTION = 0.95
_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_MAPPED = 0x02

_live_lock = threading.Lock()
_live_pool: HostPool | None = None


class HostPoolError(RuntimeError):
    """The host pool cannot be created as configured; the message says what to change."""


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
        raise HostPoolError(
            f"HiSparse host pool of {size / 2**30:.2f} GiB exceeds 95% of the "
            f"{available / 2**30:.2f} GiB of host memory available; set host_pool_gib <= "
            f"{limit / 2**30:.2f}."
        )


class HostPool:
    """One pinned (CUDA) or plain (CPU) host backing of ``size`` bytes, one per process."""

    def __init__(self, size: int, *, pin: bool | None = None) -> None:
        global _live_pool
        if size <= 0:
            raise HostPoolError(f"HiSparse host pool size must be positive, got {size} bytes.")
        check_host_memory(size)
        self.size = size
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned and not torch.cuda.is_available():
            raise HostPoolError("a pinned host pool needs CUDA; use pin=False on a CPU run.")
        with _live_lock:
            if _live_pool is not None:
                raise HostPoolError(
                    "a HiSparse host pool already exists in this process; close() it first "
                    "(one pinned backing per process keeps registration exact and bounded)."
                )
            self._backing: torch.Tensor | None = torch.empty(size, dtype=torch.uint8)
            self._registered = False
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
            _live_pool = self

    @property
    def backing(self) -> torch.Tensor:
        if self._backing is None:
            raise HostPoolError("the HiSparse host pool was closed.")
        return self._backing

    def close(self) -> None:
        """Unregister and drop the backing now (idempotent)."""
        global _live_pool
        with _live_lock:
            if self._backing is None:
                return
            if self._registered:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self._backing.data_ptr())
                self._registered = False
            self._backing = None
            if _live_pool is self:
                _live_pool = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def is_host_pool_memory(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` views this process's registered host pool (or torch-pinned memory).

    torch's ``is_pinned`` may not recognise ranges registered with ``cudaHostRegister``; the
    pool knows its own range.
    """
    pool = _live_pool
    if pool is not None and pool._backing is not None and pool._registered:
        start = pool._backing.data_ptr()
        ptr = tensor.untyped_storage().data_ptr()
        if start <= ptr < start + pool.size:
            return True
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False
