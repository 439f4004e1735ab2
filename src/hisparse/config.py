"""User-facing HiSparse settings and their resolution into checked, concrete values.

`HiSparseConfig` is what a user writes; `ResolvedHiSparseConfig` is what the runtime and the
layout planner consume: every default filled in and every limit of docs/design.md §8 checked, so a
bad value fails at start with a message that names the field and a value that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse import envs
from hisparse.validation import HiSparseConfigError as HiSparseConfigError  # re-exported
from hisparse.validation import HiSparseTypeError as HiSparseTypeError
from hisparse.validation import check_bool, check_choice, check_int
from hisparse.validation import check_gib as _check_gib

#: The LRU order is stored as int16 slot numbers, so a hot buffer holds at most this many rows.
MAX_DEVICE_BUFFER_SIZE = 32768
#: Most tokens per block (block ids times block_size address rows as int32).
MAX_BLOCK_SIZE = 4096
#: Rows are copied with 16-byte accesses.
ROW_ALIGNMENT_BYTES = 16
#: `HiSparseConfig.offload`: when a request's older pages leave the GPU
OFFLOAD_POLICIES = ("always", "under_pressure")
#: The policy when `HiSparseConfig.offload` is unset; ``$HISPARSE_OFFLOAD`` overrides it.
DEFAULT_OFFLOAD = "under_pressure"


def default_offload() -> str:
    """`DEFAULT_OFFLOAD`, or the policy ``$HISPARSE_OFFLOAD`` names (checked)."""
    try:
        return envs.value("HISPARSE_OFFLOAD") or DEFAULT_OFFLOAD
    except ValueError as err:
        raise HiSparseConfigError(str(err)) from None


def check_gib(name: str, value: float) -> None:
    """Refuse a memory size that is not a positive, finite number of GiB (``name``: the
    option or argument as the user wrote it)."""
    _check_gib(name, value)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HiSparseConfig:
    """How HiSparse offloads the KV cache.

    Attributes:
        top_k: rows each query token attends to (the model's ``index_topk`` when ``None``).
        device_buffer_size: hot rows per request and layer on the GPU; default
            ``(max_query_len + 1) * top_k``.
        host_pool_gib: size of the pinned host pool that holds every KV row; ``None``
            (default): what ``max_num_seqs`` requests of ``max_model_len`` tokens of the model
            need, capped at half the host memory available (`LLM`).
        block_size: tokens per KV block (host and GPU alike).
        eager_host_mirror: copy each decode step's new rows to the host in the same step
            (otherwise rows are written back when their resident page is spilled).
        max_query_len: most rows one request brings to a decode step (1 + speculative tokens).
        offload: ``"under_pressure"`` (default, ``None``; ``$HISPARSE_OFFLOAD`` overrides): a
            request keeps every page it writes resident while the GPU pool has free blocks,
            and its older pages go to the host (it starts reading through the hot buffer)
            only when another request needs the room; ``"always"``: a request keeps only its
            tail pages on the GPU and reads the rest through its hot buffer from the start.
            Same tokens either way; capacity is the same (the plan counts the tail pages).
    """

    top_k: int | None = None
    device_buffer_size: int | None = None
    host_pool_gib: float | None = None
    block_size: int = 64
    eager_host_mirror: bool = True
    max_query_len: int = 1
    offload: str | None = None

    def __post_init__(self) -> None:
        """Types and ranges of each field (`hisparse.validation`); `resolve` checks how they
        fit together and with the model."""
        f = "HiSparseConfig."
        check_int(f + "top_k", self.top_k, minimum=1, example=2048, optional=True)
        check_int(f + "device_buffer_size", self.device_buffer_size, minimum=1, optional=True)
        _check_gib(f + "host_pool_gib", self.host_pool_gib, optional=True, example=64)
        check_int(f + "block_size", self.block_size, minimum=1, maximum=MAX_BLOCK_SIZE, example=64)
        check_bool(f + "eager_host_mirror", self.eager_host_mirror)
        check_int(f + "max_query_len", self.max_query_len, minimum=1, example=1)
        if self.offload is not None:
            check_choice(f + "offload", self.offload, OFFLOAD_POLICIES)

    def resolve(self, model_top_k: int | None = None) -> ResolvedHiSparseConfig:
        """Fill in defaults and check every limit; raises `HiSparseConfigError`."""
        top_k = self.top_k if self.top_k is not None else model_top_k
        if top_k is None:
            raise HiSparseConfigError(
                "HiSparseConfig.top_k is not set and the model declares no index_topk; "
                "set top_k, e.g. top_k=2048."
            )
        check_int("HiSparseConfig.top_k", top_k, minimum=1, example=2048)
        minimum = self.max_query_len * top_k
        f, most = "HiSparseConfig.", MAX_DEVICE_BUFFER_SIZE
        if minimum > most:
            # no hot buffer can hold one step's rows: top_k itself is what to change
            largest = most // self.max_query_len
            need = f"at most {largest}: one decode step may read max_query_len * top_k rows "
            need += f"and a hot buffer holds at most {most} (int16 LRU slots)"
            raise HiSparseConfigError(
                f"HiSparseConfig.top_k={top_k} must be {need}; set top_k <= {largest}.",
                field=f + "top_k", value=top_k, requirement=need, example=min(2048, largest),
            )  # fmt: skip
        if self.device_buffer_size is None:
            buffer = min((self.max_query_len + 1) * top_k, most)
        else:
            buffer = self.device_buffer_size
        if not minimum <= buffer <= most:
            need = f"between max_query_len * top_k = {self.max_query_len} * {top_k} = "
            need += f"{minimum} (one step can want that many distinct rows) and {most} (the "
            need += "most hot slots the int16 LRU state can order)"
            raise HiSparseConfigError(
                f"HiSparseConfig.device_buffer_size={buffer} must be {need}. Set "
                f"device_buffer_size {'>=' if buffer < minimum else '<='} "
                f"{minimum if buffer < minimum else most}.",
                field=f + "device_buffer_size", value=buffer, requirement=need,
                example=min(2 * minimum, most),
            )  # fmt: skip
        return ResolvedHiSparseConfig(
            top_k=top_k,
            device_buffer_size=buffer,
            host_pool_bytes=None if self.host_pool_gib is None else int(self.host_pool_gib * 2**30),
            block_size=self.block_size,
            eager_host_mirror=self.eager_host_mirror,
            max_query_len=self.max_query_len,
            offload=self.offload if self.offload is not None else default_offload(),
        )


@dataclass(frozen=True)
class ResolvedHiSparseConfig:
    """Concrete, checked HiSparse settings (see `HiSparseConfig` for the meaning)."""

    top_k: int
    device_buffer_size: int
    #: ``None``: not chosen yet (`LLM` sizes it to the model before planning the layout)
    host_pool_bytes: int | None
    block_size: int
    eager_host_mirror: bool
    max_query_len: int
    offload: str = DEFAULT_OFFLOAD

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
