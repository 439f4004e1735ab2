"""User-facing HiSparse settings and their resolution into checked, concrete values.

`HiSparseConfig` is what a user writes; `ResolvedHiSparseConfig` is what the runtime and the
layout planner consume: every default filled in and every limit of DESIGN.md §5 checked, so a
bad value fails at start with a message that names the field and a value that would work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The LRU order is stored as int16 slot numbers, so a hot buffer holds at most this many rows.
MAX_DEVICE_BUFFER_SIZE = 32768
#: Rows are copied with 16-byte accesses.
ROW_ALIGNMENT_BYTES = 16


class HiSparseConfigError(ValueError):
    """A configuration value HiSparse cannot run with; the message says what to change."""


def check_gib(name: str, value: float) -> None:
    """Refuse a memory size that is not a positive, finite number of GiB (``name``: the
    option or argument as the user wrote it)."""
    if not (math.isfinite(value) and value > 0):
        raise HiSparseConfigError(f"{name}={value} must be a positive, finite number of GiB.")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HiSparseConfig:
    """How HiSparse offloads the KV cache.

    Attributes:
        top_k: rows each query token attends to (the model's ``index_topk`` when ``None``).
        device_buffer_size: hot rows per request and layer on the GPU; default
            ``(max_query_len + 1) * top_k``.
        host_pool_gib: size of the pinned host pool that holds every KV row.
        block_size: tokens per KV block (host and GPU alike).
        eager_host_mirror: copy each decode step's new rows to the host in the same step
            (otherwise rows are written back when their resident page is spilled).
        max_query_len: most rows one request brings to a decode step (1 + speculative tokens).
    """

    top_k: int | None = None
    device_buffer_size: int | None = None
    host_pool_gib: float = 16.0
    block_size: int = 64
    eager_host_mirror: bool = True
    max_query_len: int = 1

    def resolve(self, model_top_k: int | None = None) -> ResolvedHiSparseConfig:
        """Fill in defaults and check every limit; raises `HiSparseConfigError`."""
        top_k = self.top_k if self.top_k is not None else model_top_k
        if top_k is None:
            raise HiSparseConfigError(
                "HiSparseConfig.top_k is not set and the model declares no index_topk; "
                "set top_k, e.g. top_k=2048."
            )
        _require_positive_int("top_k", top_k, example=2048)
        _require_positive_int("block_size", self.block_size, example=64)
        _require_positive_int("max_query_len", self.max_query_len, example=1)
        minimum = self.max_query_len * top_k
        if self.device_buffer_size is None:
            buffer = (self.max_query_len + 1) * top_k
            if buffer > MAX_DEVICE_BUFFER_SIZE:
                buffer = max(minimum, MAX_DEVICE_BUFFER_SIZE)
        else:
            buffer = self.device_buffer_size
            _require_positive_int("device_buffer_size", buffer, example=2 * top_k)
        if buffer < minimum:
            raise HiSparseConfigError(
                f"HiSparseConfig.device_buffer_size={buffer} is smaller than "
                f"max_query_len * top_k = {self.max_query_len} * {top_k} = {minimum}: one step "
                f"can want that many distinct rows. Set device_buffer_size >= {minimum}."
            )
        if buffer > MAX_DEVICE_BUFFER_SIZE:
            raise HiSparseConfigError(
                f"HiSparseConfig.device_buffer_size={buffer} exceeds {MAX_DEVICE_BUFFER_SIZE}, "
                "the most hot slots the int16 LRU state can order. Set device_buffer_size "
                f"between {minimum} and {MAX_DEVICE_BUFFER_SIZE}"
                + (
                    "."
                    if minimum <= MAX_DEVICE_BUFFER_SIZE
                    else f" (which also needs max_query_len * top_k <= {MAX_DEVICE_BUFFER_SIZE})."
                )
            )
        if not (
            isinstance(self.host_pool_gib, int | float)
            and math.isfinite(self.host_pool_gib)
            and self.host_pool_gib > 0
        ):
            raise HiSparseConfigError(
                f"HiSparseConfig.host_pool_gib={self.host_pool_gib!r} must be a positive number "
                "of GiB, e.g. host_pool_gib=64."
            )
        return ResolvedHiSparseConfig(
            top_k=top_k,
            device_buffer_size=buffer,
            host_pool_bytes=int(self.host_pool_gib * 2**30),
            block_size=self.block_size,
            eager_host_mirror=self.eager_host_mirror,
            max_query_len=self.max_query_len,
        )


@dataclass(frozen=True)
class ResolvedHiSparseConfig:
    """Concrete, checked HiSparse settings (see `HiSparseConfig` for the meaning)."""

    top_k: int
    device_buffer_size: int
    host_pool_bytes: int
    block_size: int
    eager_host_mirror: bool
    max_query_len: int

    @property
    def hot_blocks_per_request(self) -> int:
        return cdiv(self.device_buffer_size, self.block_size)

    def check_row_bytes(self, row_bytes: int, what: str = "KV row") -> None:
        """Rows move with 16-byte accesses, so their size must be a multiple of 16."""
        if row_bytes <= 0 or row_bytes % ROW_ALIGNMENT_BYTES:
            nearest = cdiv(max(row_bytes, 1), ROW_ALIGNMENT_BYTES) * ROW_ALIGNMENT_BYTES
            raise HiSparseConfigError(
                f"{what} is {row_bytes} bytes; HiSparse copies rows with 16-byte accesses, so "
                f"a row must be a multiple of {ROW_ALIGNMENT_BYTES} bytes (pad it to {nearest})."
            )

    def min_host_blocks(self, max_model_len: int) -> int:
        """One request at max_model_len, plus the null block and a copy-on-write tail."""
        return cdiv(max_model_len, self.block_size) + 2


def _require_positive_int(field: str, value: object, *, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HiSparseConfigError(
            f"HiSparseConfig.{field}={value!r} must be a positive integer, e.g. {field}={example}."
        )
