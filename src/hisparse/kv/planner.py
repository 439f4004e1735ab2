"""The KV layout planner: from per-layer cache specs to a `KVLayout` (host and GPU pools).

It sizes the pools, packs the GPU groups, gives every layer its view and refuses settings that
cannot work with a message naming the field to change. Kept apart from `hisparse.kv.layout`
(the result type, its capacity and its report) so the planning reads on its own; where the
bytes go is described there and in docs/design.md §4.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from hisparse.config import (
    HiSparseConfigError,
    ResolvedHiSparseConfig,
    cdiv,
)
from hisparse.kv.layer_names import compact_layer_names
from hisparse.kv.layout import (
    DEFAULT_PREFILL_TOKENS,
    NULL_BLOCKS,
    PLACEMENTS,
    RESIDENT_PEAK_PAGES,
    DeviceGroup,
    GroupKind,
    IndexGroupLayout,
    KVLayout,
    Placement,
    ceil_gib,
    format_gib,
)
from hisparse.kv.packing import choose_packing
from hisparse.kv.paged_view import PagedViewSpec
from hisparse.kv.specs import CacheKind, LayerCacheSpec


def host_pool_block_bytes(
    specs: Sequence[LayerCacheSpec], block_size: int, host_indexer_copy: bool = False
) -> int:
    """One host block's bytes for ``specs`` on one rank's (unsharded) pool, as
    `plan_kv_layout` lays it out: every sparse layer's page, and with ``host_indexer_copy``
    every indexer layer's page. A parallel engine's driver checks the pool with it
    (`check_host_pool`) before any rank starts."""
    sparse = [s for s in specs if s.kind is CacheKind.SPARSE]
    block = sum(g.token_bytes for g in _index_groups(sparse, 1)) * block_size
    if host_indexer_copy:
        block += sum(s.page_bytes for s in specs if s.kind is CacheKind.INDEXER)
    return block


def plan_kv_layout(
    specs: Sequence[LayerCacheSpec],
    config: ResolvedHiSparseConfig,
    gpu_budget_bytes: int,
    max_model_len: int,
    placement: Placement = "hisparse",
    *,
    check_capacity: bool = True,
    host_shards: int = 1,
    host_shard: int = 0,
    max_num_batched_tokens: int = DEFAULT_PREFILL_TOKENS,
    max_num_seqs: int | None = None,
    host_indexer_copy: bool = False,
) -> KVLayout:
    """Plan host and GPU pools for ``specs``; raises `HiSparseConfigError` on bad settings.

    ``gpu_budget_bytes`` is the GPU memory left for KV after weights. With
    ``check_capacity=False`` a GPU pool too small for one ``max_model_len`` request is
    returned rather than refused (the CLI reports such a baseline as holding 0 requests).
    ``host_shards`` > 1: ``specs`` give one tensor-parallel rank's slice of each sparse row,
    the host rows hold ``host_shards`` such slices, and the host views are rank
    ``host_shard``'s.
    HiSparse reserves the prefill staging area out of the budget first: rows for one
    ``max_model_len`` context plus one step's prompt tokens (``max_num_batched_tokens``, at
    most ``max_num_seqs - 1`` other prompts' worth when given), one sparse layer's rows each
    (docs/design.md §4.3, §6.6).
    ``host_indexer_copy`` (HiSparse, prefix caching): every host block also holds a copy of
    its page's indexer keys, every indexer layer's page side by side after the rows, so a
    cached page restores them on a hit (docs/design.md §12.10).
    """
    if not 0 <= host_shard < host_shards:
        raise ValueError(f"host_shard={host_shard} must be in [0, host_shards={host_shards})")
    if placement not in PLACEMENTS:
        raise HiSparseConfigError(f"placement {placement!r} is not one of {PLACEMENTS}.")
    if max_model_len <= 0:
        raise HiSparseConfigError(f"max_model_len={max_model_len} must be positive.")
    if gpu_budget_bytes < 0:
        raise HiSparseConfigError(f"gpu_budget_bytes={gpu_budget_bytes} must not be negative.")
    if max_num_batched_tokens <= 0:
        raise HiSparseConfigError(
            f"max_num_batched_tokens={max_num_batched_tokens} must be positive."
        )
    specs = list(specs)
    _check_specs(specs, config, placement)
    bs = config.block_size
    sparse = [s for s in specs if s.kind is CacheKind.SPARSE]
    indexers = [s for s in specs if s.kind is CacheKind.INDEXER]
    regular = [s for s in specs if s.kind is CacheKind.REGULAR]
    by_name = {s.name: s for s in specs}
    hisparse = placement == "hisparse"

    # Host: index groups one after another, token-major inside each.
    index_groups = _index_groups(sparse, host_shards)
    host_block_bytes = sum(g.token_bytes for g in index_groups) * bs * host_shards
    host_indexer_offset = host_block_bytes
    if hisparse and host_indexer_copy:
        if host_shards > 1:
            raise HiSparseConfigError(
                "prefix caching keeps the indexer keys in the host pool, which tensor "
                "parallelism shards: turn prefix caching off (enable_prefix_caching=False)."
            )
        host_block_bytes += sum(s.page_bytes for s in indexers)
    host_num_blocks = config.host_pool_bytes // host_block_bytes if hisparse else 0
    if hisparse:
        check_host_pool(config, host_block_bytes, host_num_blocks, max_model_len)
    host_views: dict[str, PagedViewSpec] = {}
    if hisparse:
        for group in index_groups:
            within = 0
            for name, row in zip(group.layers, group.row_bytes, strict=True):
                host_views[name] = PagedViewSpec(
                    offset=group.host_offset + host_shard * group.token_bytes + within,
                    block_stride=host_block_bytes,
                    row_stride=group.token_bytes * host_shards,
                    row_bytes=row,
                    num_blocks=host_num_blocks,
                    block_size=bs,
                )
                within += row

    # GPU: overlaying groups, each page starting at byte 0 of a block.
    if not hisparse:
        # All-GPU: every page of every layer is resident for the whole context, so one group
        # holding all layers fills each block exactly (overlaying groups would pad the KV
        # packs up to the indexer page and understate the baseline's capacity).
        return _finish(
            placement,
            config,
            max_model_len,
            gpu_budget_bytes,
            check_capacity,
            by_name,
            index_groups,
            (_device_group(GroupKind.RESIDENT, indexers + sparse + regular),),
            host_block_bytes=0,
            host_num_blocks=0,
            host_views={},
        )
    units = [[by_name[n] for n in g.layers] for g in index_groups]
    m, packs, regular_packs = choose_packing(
        units,
        indexers,
        regular,
        pages=cdiv(max_model_len, bs),
        hot_pages=config.hot_blocks_per_request,
        tail_pages=min(RESIDENT_PEAK_PAGES, cdiv(max_model_len, bs)),
    )
    indexer_group = _device_group(GroupKind.INDEXER, indexers, m) if indexers else None
    resident = [_device_group(GroupKind.RESIDENT, pack) for pack in packs]
    hot = [_device_group(GroupKind.HOT, pack) for pack in packs]
    regular_groups = [_device_group(GroupKind.REGULAR, p) for p in regular_packs]
    gpu_groups = tuple(
        [g for g in (indexer_group,) if g is not None] + resident + hot + regular_groups
    )
    staging_blocks = staging_pages(max_model_len, max_num_batched_tokens, bs, max_num_seqs)
    staging_row = max(s.row_bytes for s in sparse)
    return _finish(
        placement,
        config,
        max_model_len,
        gpu_budget_bytes,
        check_capacity,
        by_name,
        index_groups,
        gpu_groups,
        host_block_bytes=host_block_bytes,
        host_num_blocks=host_num_blocks,
        host_views=host_views,
        staging_blocks=staging_blocks,
        staging_row_bytes=staging_row,
        host_indexer_offset=host_indexer_offset if host_indexer_copy and indexers else 0,
    )


def staging_pages(
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int,
    max_num_seqs: int | None = None,
) -> int:
    """Pages (of ``block_size`` rows) of the prefill staging area: one row per context
    position of a step's prefilling requests. In admission order only the first of them can
    be past its first chunk (a later one gets tokens only when the earlier ones finish in the
    same step), so a ``max_model_len`` context plus one step's prompt tokens (no more than
    ``max_num_seqs - 1`` other prompts hold) is enough: the scheduler keeps every step within
    it, and it never changes a schedule (docs/design.md §6.6)."""
    others = max_num_batched_tokens
    if max_num_seqs is not None:
        others = min(others, max(max_num_seqs - 1, 0) * max_model_len)
    return cdiv(max_model_len + others, block_size)


def _finish(
    placement: Placement,
    config: ResolvedHiSparseConfig,
    max_model_len: int,
    gpu_budget_bytes: int,
    check_capacity: bool,
    by_name: Mapping[str, LayerCacheSpec],
    index_groups: list[IndexGroupLayout],
    gpu_groups: tuple[DeviceGroup, ...],
    *,
    host_block_bytes: int,
    host_num_blocks: int,
    host_views: dict[str, PagedViewSpec],
    staging_blocks: int = 0,
    staging_row_bytes: int = 0,
    host_indexer_offset: int = 0,
) -> KVLayout:
    """Size the GPU pool for ``gpu_groups``, give every layer its view, check capacity."""
    bs = config.block_size
    bytes_per_block = max(g.page_bytes * g.pages_per_block for g in gpu_groups)
    staging_bytes = staging_blocks * bs * staging_row_bytes
    gpu_num_blocks = max(gpu_budget_bytes - staging_bytes, 0) // bytes_per_block
    gpu_views: dict[str, PagedViewSpec] = {}
    for group in gpu_groups:
        if group.kind is GroupKind.HOT or gpu_num_blocks == 0:
            continue  # a hot group repeats its resident twin's offsets
        m = group.pages_per_block
        for name, offset in zip(group.layers, group.layer_offsets, strict=True):
            # m pages per block: one view over every page, its "block" the page (page ids
            # b * m + i, uniformly strided since a block is exactly m pages of the group)
            assert m == 1 or m * group.page_bytes == bytes_per_block, "a block is m pages"
            gpu_views[name] = PagedViewSpec(
                offset=offset,
                block_stride=bytes_per_block if m == 1 else group.page_bytes,
                row_stride=by_name[name].row_bytes,
                row_bytes=by_name[name].row_bytes,
                num_blocks=gpu_num_blocks * m,
                block_size=bs,
            )

    layout = KVLayout(
        placement=placement,
        block_size=bs,
        max_model_len=max_model_len,
        hot_blocks_per_request=(config.hot_blocks_per_request if placement == "hisparse" else 0),
        index_groups=tuple(index_groups),
        host_block_bytes=host_block_bytes,
        host_num_blocks=host_num_blocks,
        host_views=MappingProxyType(host_views),
        gpu_bytes_per_block=bytes_per_block,
        gpu_num_blocks=gpu_num_blocks,
        gpu_groups=gpu_groups,
        gpu_views=MappingProxyType(gpu_views),
        staging_blocks=staging_blocks,
        staging_row_bytes=staging_row_bytes,
        host_indexer_offset=host_indexer_offset,
    )
    if check_capacity:
        _check_gpu_pool(layout, gpu_budget_bytes)
    return layout


# -- validation -------------------------------------------------------------------------------


def _check_specs(
    specs: list[LayerCacheSpec], config: ResolvedHiSparseConfig, placement: Placement
) -> None:
    if not specs:
        raise HiSparseConfigError("the model declares no KV cache specs; nothing to lay out.")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise HiSparseConfigError(f"cache spec names must be unique; repeated: {dupes}.")
    for spec in specs:
        if spec.row_bytes <= 0:
            raise HiSparseConfigError(f"{spec.name}: row_bytes={spec.row_bytes} must be positive.")
    if placement == "hisparse":
        first = specs[0]
        if first.kind is not CacheKind.SPARSE:
            raise HiSparseConfigError(
                "HiSparse requires the model's first cache group to be sparse MLA; got "
                f"{first.name} ({first.kind.value}). HiSparse offloads only DSA sparse-MLA "
                "layers: run this model with placement='gpu', or list a sparse MLA layer first."
            )
        if not any(s.kind is CacheKind.INDEXER for s in specs):
            raise HiSparseConfigError(
                "HiSparse needs the model's lightning-indexer caches (kind 'indexer') to pick "
                "each step's top-k rows, but the specs have none. Add an indexer spec for "
                "every layer that runs an indexer, or run with placement='gpu'."
            )
        for spec in specs:
            if spec.kind is CacheKind.SPARSE:
                config.check_row_bytes(spec.row_bytes, what=f"{spec.name}'s KV row")
    by_size: dict[int, list[str]] = {}
    for spec in specs:
        by_size.setdefault(spec.block_size, []).append(spec.name)
    if len(by_size) > 1:
        listing = "; ".join(
            f"block_size {size}: {compact_layer_names(layers)}" for size, layers in by_size.items()
        )
        raise HiSparseConfigError(
            "HiSparse needs one block size for every cache (one block id addresses a page of "
            f"every group); got {listing}. Build every spec with "
            f"block_size={config.block_size} (HiSparseConfig.block_size)."
        )
    (size,) = by_size
    if size != config.block_size:
        raise HiSparseConfigError(
            f"the cache specs use block_size={size} but HiSparseConfig.block_size="
            f"{config.block_size}; set HiSparseConfig(block_size={size}) or build the specs "
            f"with block_size={config.block_size}."
        )


def _index_groups(sparse: list[LayerCacheSpec], shards: int = 1) -> list[IndexGroupLayout]:
    """Split sparse layers into index groups; host offsets accumulate group by group (each
    token's span holding ``shards`` slices of the specs' rows)."""
    groups: list[tuple[str, list[LayerCacheSpec]]] = []
    seen: set[str] = set()
    for spec in sparse:
        leader = spec.index_leader or spec.name
        if leader == spec.name:
            groups.append((leader, [spec]))
        elif leader not in seen:
            raise HiSparseConfigError(
                f"{spec.name} has index_leader={leader!r}, which is not an earlier sparse MLA "
                "layer: a layer can only reuse the top-k of a sparse layer that runs before "
                f"it. Set index_leader to an earlier sparse layer, or to {spec.name!r} to give "
                "it its own indexer."
            )
        elif groups[-1][0] != leader:
            raise HiSparseConfigError(
                f"{spec.name} has index_leader={leader!r}, but the index group of "
                f"{groups[-1][0]!r} comes in between: an index group must be consecutive "
                f"sparse layers. Set index_leader={groups[-1][0]!r} or give {spec.name!r} "
                "its own indexer."
            )
        else:
            groups[-1][1].append(spec)
        seen.add(spec.name)
    result = []
    offset = 0
    block_size = sparse[0].block_size if sparse else 0
    for leader, members in groups:
        rows = tuple(s.row_bytes for s in members)
        names = tuple(s.name for s in members)
        result.append(IndexGroupLayout(leader, names, rows, offset, shards))
        offset += sum(rows) * block_size * shards
    return result


#: Physical rows (block * block_size + offset) are int32 in every data-plane op.
MAX_ROWS = 2**31


def check_host_pool(
    config: ResolvedHiSparseConfig, block_bytes: int, num_blocks: int, max_model_len: int
) -> None:
    """The host pool's checks (`plan_kv_layout`, HiSparse): rows addressable as int32, and
    room for one ``max_model_len`` request."""
    need = config.min_host_blocks(max_model_len)
    rows = num_blocks * config.block_size
    if rows >= MAX_ROWS:
        fit = (MAX_ROWS - 1) // config.block_size * block_bytes
        raise HiSparseConfigError(
            f"the host pool of {format_gib(config.host_pool_bytes)} holds {rows:,} token rows; "
            f"the kernels address rows as int32 (fewer than {MAX_ROWS:,}). Set host_pool_gib "
            f"<= {math.floor(10 * fit / 2**30) / 10}."
        )
    if num_blocks < need:
        raise HiSparseConfigError(
            f"the host pool of {format_gib(config.host_pool_bytes)} holds {num_blocks} blocks "
            f"of {block_bytes:,} B, but one max_model_len={max_model_len} request needs {need} "
            f"(its pages plus the null block and a copy-on-write tail). Set host_pool_gib >= "
            f"{ceil_gib(need * block_bytes)} or lower max_model_len."
        )


def _check_gpu_pool(layout: KVLayout, budget: int) -> None:
    per_block = layout.gpu_bytes_per_block
    staging = layout.staging_bytes
    also = f" beside the {format_gib(staging)} prefill staging area" if staging else ""
    if layout.gpu_num_blocks < NULL_BLOCKS + 1:
        raise HiSparseConfigError(
            f"the GPU KV budget of {format_gib(budget)} ({budget:,} B) is smaller than two "
            f"blocks of {per_block:,} B (block 0 is the null block){also}, so it holds no "
            f"usable block. Give the KV cache >= {ceil_gib(2 * per_block + staging)} of GPU "
            "memory (gpu_memory_gib)."
        )
    per_request = layout.gpu_blocks_per_request(layout.max_model_len)
    need = per_request + NULL_BLOCKS
    if layout.gpu_num_blocks < need:
        hint = " or a smaller device_buffer_size" if layout.placement == "hisparse" else ""
        total = ceil_gib(need * per_block + staging)
        raise HiSparseConfigError(
            f"the GPU KV budget of {format_gib(budget)} holds {layout.gpu_num_blocks} blocks "
            f"of {per_block:,} B{also}, but one max_model_len={layout.max_model_len} request "
            f"needs {per_request} blocks plus the null block. Give the KV cache >= {total} of "
            f"GPU memory (gpu_memory_gib), or lower max_model_len{hint}."
        )


# -- helpers ----------------------------------------------------------------------------------


def _device_group(
    kind: GroupKind, specs: Iterable[LayerCacheSpec], pages_per_block: int = 1
) -> DeviceGroup:
    names, offsets = [], []
    offset = 0
    for spec in specs:
        names.append(spec.name)
        offsets.append(offset)
        offset += spec.page_bytes
    return DeviceGroup(kind, tuple(names), tuple(offsets), offset, pages_per_block)
