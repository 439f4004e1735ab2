"""Where one layer's rows live inside a flat, block-paged byte pool.

Host and GPU pools are single flat ``uint8`` allocations shared by many layers (block-outermost:
one block id addresses a page of every layer of a group). A `PagedViewSpec` records the strides
that pick one layer's rows out of such a pool, so every consumer (attention, gathers, mirrors,
tests) builds the identical ``[num_blocks, block_size, row_bytes]`` view instead of recomputing
offsets by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PagedViewSpec:
    """Byte strides of one layer's rows in a flat pool.

    Row ``(block, token)`` of the layer starts at
    ``offset + block * block_stride + token * row_stride`` and is ``row_bytes`` long.
    ``row_stride > row_bytes`` when other layers' rows of the same token sit in between
    (token-major host layout of an index group).
    """

    offset: int
    block_stride: int
    row_stride: int
    row_bytes: int
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if min(self.row_bytes, self.num_blocks, self.block_size) <= 0 or self.offset < 0:
            raise ValueError(f"invalid PagedViewSpec {self}")
        if self.row_stride < self.row_bytes:
            raise ValueError(f"row_stride {self.row_stride} < row_bytes {self.row_bytes}")
        if self.block_stride < (self.block_size - 1) * self.row_stride + self.row_bytes:
            raise ValueError(f"block_stride {self.block_stride} is smaller than one page")

    @property
    def span_bytes(self) -> int:
        """Bytes of the pool this view reaches into (the pool must be at least this long)."""
        return (
            self.offset
            + (self.num_blocks - 1) * self.block_stride
            + (self.block_size - 1) * self.row_stride
            + self.row_bytes
        )

    @property
    def page_is_contiguous(self) -> bool:
        """True when one block's rows form one dense ``block_size * row_bytes`` span."""
        return self.row_stride == self.row_bytes

    def view(self, raw: torch.Tensor) -> torch.Tensor:
        """The ``[num_blocks, block_size, row_bytes]`` uint8 view of this layer in ``raw``.

        ``raw`` is the whole pool: a 1-D contiguous uint8 tensor (host or GPU). Writes through
        the view land in the pool, which is the point: no copies, one address space.
        """
        self._check_raw(raw)
        return raw.as_strided(
            (self.num_blocks, self.block_size, self.row_bytes),
            (self.block_stride, self.row_stride, 1),
            raw.storage_offset() + self.offset,
        )

    def page_view(self, raw: torch.Tensor) -> torch.Tensor:
        """The ``[num_blocks, block_size * row_bytes]`` view of whole pages.

        Only for contiguous pages (every GPU layer): kernels with their own in-page format,
        like the indexer's keys-then-scales page, address the page as plain bytes.
        """
        if not self.page_is_contiguous:
            raise ValueError("page_view needs row_stride == row_bytes (token-major pages are not)")
        self._check_raw(raw)
        return raw.as_strided(
            (self.num_blocks, self.block_size * self.row_bytes),
            (self.block_stride, 1),
            raw.storage_offset() + self.offset,
        )

    def _check_raw(self, raw: torch.Tensor) -> None:
        import torch

        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise ValueError(
                f"a PagedViewSpec views a flat contiguous uint8 pool; got dtype={raw.dtype}, "
                f"shape={tuple(raw.shape)}"
            )
        if raw.numel() < self.span_bytes:
            raise ValueError(
                f"pool has {raw.numel()} bytes but this view reaches {self.span_bytes} bytes"
            )
