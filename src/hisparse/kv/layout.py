"""The KV layout: host and GPU block pools, their groups and every layer's view.

`KVLayout` is what the planner (`hisparse.kv.planner.plan_kv_layout`) returns and what the
engine, the scheduler and the CLI read: pool sizes, per-request capacity and the printed
report; how the pools are sized and checked lives in the planner.

HiSparse placement (docs/design.md §4):

* **Host pool** (pinned): every sparse layer's full cache. Block-outermost: one host block id
  addresses ``block_size`` tokens of every sparse layer. Inside a block the index groups follow
  each other; inside a group of ``G`` layers the bytes are token-major,
  ``[block_size][G][row_bytes]``, so a leader gathering a token for its whole group reads one
  ``G * row_bytes`` span instead of ``G`` scattered rows (docs/design.md §10: span length is
  the PCIe lever).
* **GPU pool**: one block pool shared by overlaying groups (a block id belongs to one group at
  a time). Groups: the indexer group (every indexer layer's page side by side, ``m`` such
  pages per block), then resident and hot groups packed from whole index groups into the block
  (first fit, largest first), then regular (non-sparse) groups. The block is ``m`` indexer
  pages; ``m`` is chosen so a ``max_model_len`` request's blocks waste the fewest bytes
  (docs/design.md §4.2). A pack's resident and hot group share layer order and in-page
  offsets, so a layer's resident and hot rows are one address space and attention reads one
  tensor.

"gpu" placement (the all-GPU baseline) has no host pool and no hot groups: one resident group
holds every layer (indexer included), so each block is filled exactly and every page is resident.

Tensor parallelism with rows sharded by KV head (GQA, docs/design.md §18): a host row holds
every rank's slice side by side (``host_shards`` slices of the rank's ``row_bytes``), so the
host pool is the one-rank pool whatever the rank count; each rank's host views address its
own slice (``host_shard``). MLA rows are the same on every rank: one shard, one view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from rich.table import Table

from hisparse.config import cdiv
from hisparse.kv.layer_names import compact_layer_names, summarize_index_groups
from hisparse.kv.paged_view import PagedViewSpec

Placement = Literal["hisparse", "gpu"]
PLACEMENTS: tuple[Placement, ...] = ("hisparse", "gpu")
#: Pages of a request a resident group keeps on the GPU under HiSparse (the write tail).
RESIDENT_TAIL_PAGES = 2
#: ... and holds at its peak: a decode step adds the next page before the oldest is dropped.
RESIDENT_PEAK_PAGES = RESIDENT_TAIL_PAGES + 1
#: Block id 0 is the null block in both the host and the GPU id space.
NULL_BLOCKS = 1
#: Prefill tokens per step the planner assumes when not told (`LLM`'s default
#: ``max_num_batched_tokens``); it sizes the prefill staging area (docs/design.md §4.3).
DEFAULT_PREFILL_TOKENS = 2048


class GroupKind(Enum):
    INDEXER = "indexer"
    RESIDENT = "resident"
    HOT = "hot"
    REGULAR = "regular"


@dataclass(frozen=True)
class DeviceGroup:
    """One group of the shared GPU pool: its layers' pages side by side in one page of
    ``page_bytes``, ``pages_per_block`` such pages per block (page ``i`` of block ``b`` at
    byte ``i * page_bytes``; its block-table id ``b * pages_per_block + i``).

    ``layer_offsets[j]`` is where layer ``layers[j]``'s page starts inside the page.
    """

    kind: GroupKind
    layers: tuple[str, ...]
    layer_offsets: tuple[int, ...]
    page_bytes: int
    pages_per_block: int = 1


@dataclass(frozen=True)
class IndexGroupLayout:
    """Where an index group lives in the host pool: consecutive sparse layers sharing one top-k
    (leader first) and one host unit. Its run-time state is `sparse_layer.IndexGroupRuntime`.

    In a host block the group occupies ``[host_offset, host_offset + block_size *
    token_bytes * shards)``; token ``t``'s rows of all its layers are the span starting at
    ``host_offset + t * token_bytes * shards`` (with ``shards`` > 1, tensor-parallel rank ``r``'s
    slices start ``r * token_bytes`` into it).
    """

    leader: str
    layers: tuple[str, ...]
    row_bytes: tuple[int, ...]
    host_offset: int
    shards: int = 1

    @property
    def token_bytes(self) -> int:
        return sum(self.row_bytes)


@dataclass(frozen=True)
class KVLayout:
    """Result of `plan_kv_layout`: pool sizes, groups and every layer's view.

    Host fields are zero / empty under "gpu" placement.
    """

    placement: Placement
    block_size: int
    max_model_len: int
    hot_blocks_per_request: int
    index_groups: tuple[IndexGroupLayout, ...]
    host_block_bytes: int
    host_num_blocks: int
    host_views: Mapping[str, PagedViewSpec]
    gpu_bytes_per_block: int
    gpu_num_blocks: int
    gpu_groups: tuple[DeviceGroup, ...]
    gpu_views: Mapping[str, PagedViewSpec]
    #: HiSparse: pages (of ``block_size`` rows) of the prefill staging area: one layer at a
    #: time, every prefilling request's context in a step
    #: (`hisparse.runtime.staging.PrefillStaging`); 0 on "gpu"
    staging_blocks: int = 0
    #: bytes of one staged row (the widest sparse row)
    staging_row_bytes: int = 0
    #: HiSparse with prefix caching: where in a host block the copy of its page's indexer
    #: keys starts (the indexer group's page, `plan_kv_layout`'s ``host_indexer_copy``);
    #: 0: no copy
    host_indexer_offset: int = 0

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def host_pool_bytes(self) -> int:
        return self.host_block_bytes * self.host_num_blocks

    @property
    def gpu_pool_bytes(self) -> int:
        return self.gpu_bytes_per_block * self.gpu_num_blocks

    @property
    def staging_bytes(self) -> int:
        """GPU bytes of the prefill staging area, outside the block pool."""
        return self.staging_blocks * self.block_size * self.staging_row_bytes

    def groups(self, kind: GroupKind) -> tuple[DeviceGroup, ...]:
        return tuple(g for g in self.gpu_groups if g.kind is kind)

    @property
    def indexer_pages_per_block(self) -> int:
        """Indexer pages per GPU block (their block-table ids are sub-block ids)."""
        return next((g.pages_per_block for g in self.groups(GroupKind.INDEXER)), 1)

    # -- capacity ------------------------------------------------------------------------------
    def gpu_blocks_per_request(self, context_len: int) -> int:
        """GPU blocks one request of ``context_len`` tokens holds at its peak: THE per-request
        need, the planner's capacity and the scheduler's admission and preemption alike
        (a prefill streams its pages to the host, so it never holds more than this).

        HiSparse: every indexer page (``pages_per_block`` to a block), ``min(3, pages)``
        pages per resident group (two tail pages, plus the one a step opens before the
        oldest is dropped), the hot region of every hot group. All-GPU: every page."""
        return sum(self.group_usage(g, context_len)[0] for g in self.gpu_groups)

    def group_usage(self, group: DeviceGroup, context_len: int) -> tuple[int, int]:
        """(GPU blocks, bytes of pages in use) of ``group`` in one request of ``context_len``
        tokens at its peak; the blocks' bytes less the pages' are the group's padding."""
        pages = _pages(context_len, self.block_size)
        if group.kind is GroupKind.RESIDENT and self.placement == "hisparse":
            n = min(RESIDENT_PEAK_PAGES, pages)
        elif group.kind is GroupKind.HOT:
            n = self.hot_blocks_per_request
        else:
            n = pages
        return cdiv(n, group.pages_per_block), n * group.page_bytes

    def gpu_bytes_per_request(self, context_len: int) -> tuple[int, int]:
        """(bytes of pages in use, bytes of the blocks holding them) of one request of
        ``context_len`` tokens at its peak. The first is the byte bound: no layout holds a
        request in fewer GPU bytes."""
        used = sum(self.group_usage(g, context_len)[1] for g in self.gpu_groups)
        return used, self.gpu_blocks_per_request(context_len) * self.gpu_bytes_per_block

    def host_blocks_per_request(self, context_len: int) -> int:
        """Host blocks of one request: every page plus a copy-on-write tail (0 on "gpu")."""
        if self.placement != "hisparse":
            return 0
        return _pages(context_len, self.block_size) + 1

    def max_requests_gpu(self, context_len: int) -> int:
        return max(self.gpu_num_blocks - NULL_BLOCKS, 0) // self.gpu_blocks_per_request(context_len)

    def max_requests_host(self, context_len: int) -> int | None:
        """Requests the host pool holds; ``None`` when there is no host pool ("gpu")."""
        if self.placement != "hisparse":
            return None
        return max(self.host_num_blocks - NULL_BLOCKS, 0) // self.host_blocks_per_request(
            context_len
        )

    def max_requests(self, context_len: int) -> int:
        """Concurrent requests of ``context_len`` tokens: the tighter of both pools."""
        gpu = self.max_requests_gpu(context_len)
        host = self.max_requests_host(context_len)
        return gpu if host is None else min(gpu, host)

    # -- rendering -----------------------------------------------------------------------------
    def describe(self) -> str:
        """A plain-text summary for logs."""
        lines = [f"KV layout ({self.placement} placement, block_size {self.block_size})"]
        if self.placement == "hisparse":
            lines.append(
                f"  host pool: {self.host_num_blocks} blocks x {self.host_block_bytes} B = "
                f"{format_gib(self.host_pool_bytes)}; index groups: "
                f"{summarize_index_groups(self.index_groups)}"
            )
        lines.append(
            f"  GPU pool: {self.gpu_num_blocks} blocks x {self.gpu_bytes_per_block} B = "
            f"{format_gib(self.gpu_pool_bytes)} (block 0 is the null block)"
        )
        for group in self.gpu_groups:
            per = f" x {group.pages_per_block} per block" if group.pages_per_block > 1 else ""
            lines.append(
                f"    {group.kind.value:<8} {compact_layer_names(group.layers)}: "
                f"{group.page_bytes} B/page{per}"
            )
        if self.staging_blocks:
            lines.append(
                f"  prefill staging: {self.staging_blocks} pages x {self.block_size} rows x "
                f"{self.staging_row_bytes} B = {format_gib(self.staging_bytes)} (one layer at a "
                "time, outside the pool)"
            )
        return "\n".join(lines)

    def groups_table(self, context_len: int | None = None) -> Table:
        """The GPU groups as a rich table; at ``context_len`` also one request's blocks of
        each group, the bytes its pages use and the padding of those blocks (block bytes not
        covered by a page)."""
        title = f"GPU groups ({self.placement})"
        if context_len is not None:
            title += f", one request of {context_len:,} tokens"
        table = Table(title=title, title_justify="left")
        table.add_column("#", justify="right")
        table.add_column("kind")
        table.add_column("layers", overflow="fold", min_width=20)
        table.add_column("page B", justify="right")
        table.add_column("pg/blk", justify="right")
        if context_len is not None:
            for column in ("blocks", "used MiB", "pad MiB", "fill"):
                table.add_column(column, justify="right")
        for i, group in enumerate(self.gpu_groups):
            row = [
                str(i),
                group.kind.value,
                compact_layer_names(group.layers),
                f"{group.page_bytes:,}",
                str(group.pages_per_block),
            ]
            if context_len is not None:
                n, used = self.group_usage(group, context_len)
                row += _usage_cells(n, used, n * self.gpu_bytes_per_block)
            table.add_row(*row)
        if context_len is not None:
            used, held = self.gpu_bytes_per_request(context_len)
            cells = _usage_cells(self.gpu_blocks_per_request(context_len), used, held)
            table.add_row("", "[bold]total[/bold]", "", "", "", *cells)
        return table


def _usage_cells(blocks: int, used: int, held: int) -> list[str]:
    """Blocks, MiB used and padding, and the fill."""
    mib = [f"{nbytes / 2**20:,.2f}" for nbytes in (used, held - used)]
    return [f"{blocks:,}", *mib, f"{used / held:.1%}"]


# -- helpers ----------------------------------------------------------------------------------


def _pages(context_len: int, block_size: int) -> int:
    if context_len <= 0:
        raise ValueError(f"context_len={context_len} must be positive")
    return cdiv(context_len, block_size)


def format_gib(nbytes: int) -> str:
    """GiB with two decimals; small pools (tests, tiny models) in MiB / KiB instead of 0.00."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale // 100:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes} B"


def ceil_gib(nbytes: int) -> str:
    """``nbytes`` rounded *up* to 0.01 GiB, so the suggested value is enough."""
    return f"{math.ceil(nbytes * 100 / 2**30) / 100:,.2f} GiB"
