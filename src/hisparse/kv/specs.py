"""Per-layer KV cache specifications: what each attention layer stores per token.

A model describes its cache as an ordered list of specs, one per cache-owning layer. The layout
planner (`hisparse.kv.planner`) turns them into host and GPU groups; the runtime uses the row
formats to address single token rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RowFormat(Enum):
    """Byte layout of one token's KV row in one layer (docs/design.md §3)."""

    #: 512 x e4m3 latent, 4 x fp32 scales (one per 128 values), 64 x bf16 RoPE = 656 B.
    FP8_DS_MLA = "fp8_ds_mla"
    #: 512 latent + 64 RoPE, all bf16 = 1152 B.
    BF16_MLA = "bf16"
    #: DSA lightning-indexer key: 128 x e4m3 + one fp32 scale = 132 B.
    INDEXER_FP8 = "indexer_fp8"
    #: K and V of every KV head of a layer in the model dtype (GQA / MHA models).
    GQA = "gqa"

    @staticmethod
    def mla_row_bytes(fmt: RowFormat, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
        if fmt is RowFormat.FP8_DS_MLA:
            return kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * rope_dim
        if fmt is RowFormat.BF16_MLA:
            return 2 * (kv_lora_rank + rope_dim)
        raise ValueError(f"{fmt.value} is not an MLA row format")


FP8_DS_MLA_ROW_BYTES = RowFormat.mla_row_bytes(RowFormat.FP8_DS_MLA)
BF16_MLA_ROW_BYTES = RowFormat.mla_row_bytes(RowFormat.BF16_MLA)
INDEXER_ROW_BYTES = 128 + 4


class CacheKind(Enum):
    SPARSE = "sparse"
    """Sparse attention rows: full copy on the host, resident tail + hot rows on the GPU."""
    INDEXER = "indexer"
    """Indexer keys: every token, always on the GPU."""
    REGULAR = "regular"
    """A layer HiSparse does not manage (dense attention): all pages on the GPU."""


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's cache: ``row_bytes`` bytes per token in ``block_size``-token pages.

    For sparse layers ``index_leader`` names the layer whose top-k this layer uses (itself for a
    layer with its own indexer); consecutive layers with one leader form an index group.
    """

    name: str
    kind: CacheKind
    row_bytes: int
    block_size: int
    row_format: RowFormat | None = None
    index_leader: str | None = None

    @property
    def page_bytes(self) -> int:
        return self.row_bytes * self.block_size

    @property
    def is_index_group_leader(self) -> bool:
        return self.kind is CacheKind.SPARSE and self.index_leader in (None, self.name)


def sparse_mla_spec(
    name: str,
    *,
    block_size: int,
    fmt: RowFormat = RowFormat.FP8_DS_MLA,
    index_leader: str | None = None,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
) -> LayerCacheSpec:
    return LayerCacheSpec(
        name=name,
        kind=CacheKind.SPARSE,
        row_bytes=RowFormat.mla_row_bytes(fmt, kv_lora_rank, rope_dim),
        block_size=block_size,
        row_format=fmt,
        index_leader=index_leader or name,
    )


def indexer_spec(name: str, *, block_size: int, head_dim: int = 128) -> LayerCacheSpec:
    return LayerCacheSpec(
        name=name,
        kind=CacheKind.INDEXER,
        row_bytes=head_dim + 4,
        block_size=block_size,
        row_format=RowFormat.INDEXER_FP8,
    )
