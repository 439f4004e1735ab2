"""Layout planner: group packing, host token-major offsets, capacity, validation messages."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.kv.cache_shapes import (
    cache_shape_from_hf_config,
    deepseek_v32_cache_shape,
    dsa_cache_specs,
    glm5_cache_shape,
    indexer_schedule,
)
from hisparse.kv.layer_names import compact_layer_names
from hisparse.kv.layout import GroupKind, KVLayout
from hisparse.kv.packing import pack
from hisparse.kv.paged_view import PagedViewSpec
from hisparse.kv.planner import plan_kv_layout, staging_pages
from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat, indexer_spec, sparse_mla_spec

GIB = 2**30


def _plan(specs, *, host_gib=1024.0, gpu_gib=60.0, max_len=131072, placement="hisparse", **kw):
    config = HiSparseConfig(host_pool_gib=host_gib, **kw).resolve(2048)
    return plan_kv_layout(specs, config, int(gpu_gib * GIB), max_len, placement)


def _tiny_specs(full, block_size=4, fmt=RowFormat.FP8_DS_MLA):
    return dsa_cache_specs(full, block_size=block_size, kv_format=fmt)


def _tiny_plan(full, *, host_blocks=6, gpu_blocks=40, max_len=8, block_size=4):
    """A few-KiB layout that a real uint8 tensor can back."""
    specs = _tiny_specs(full, block_size)
    host_block = sum(s.page_bytes for s in specs if s.kind is CacheKind.SPARSE)
    config = HiSparseConfig(
        top_k=8, host_pool_gib=(host_blocks * host_block + 1) / GIB, block_size=block_size
    ).resolve()
    budget = gpu_blocks * sum(s.page_bytes for s in specs)  # blocks are never bigger than this
    staging = staging_pages(max_len, 8, block_size) * block_size * 656
    return plan_kv_layout(specs, config, budget + staging, max_len, max_num_batched_tokens=8)


# -- models ------------------------------------------------------------------------------------


def test_deepseek_v32_specs_have_an_indexer_per_layer_in_layer_order():
    shape = deepseek_v32_cache_shape()
    assert shape.num_layers == 61 and shape.index_topk == 2048
    assert len(shape.specs) == 122
    assert shape.specs[0].name == "layers.0.attn" and shape.specs[1].name == "layers.0.indexer"
    assert shape.specs[-1].name == "layers.60.indexer"
    for spec in shape.sparse_specs:
        assert spec.row_bytes == 656 and spec.index_leader == spec.name
    assert {s.row_bytes for s in shape.indexer_specs} == {132}
    assert deepseek_v32_cache_shape(kv_format="bf16").sparse_specs[0].row_bytes == 1152


def test_glm5_indexshare_leaders():
    shape = glm5_cache_shape()
    assert shape.num_layers == 78 and shape.index_topk == 2048
    full = [i for i in range(78) if f"layers.{i}.indexer" in {s.name for s in shape.specs}]
    # zai-org/GLM-5.2: freq 4, offset 3 -> max(i - 2, 0) % 4 == 0.
    assert full == [0, 1, 2, *range(6, 78, 4)]
    assert len(full) == 21
    leaders = {s.name: s.index_leader for s in shape.sparse_specs}
    assert leaders["layers.1.attn"] == "layers.1.attn"
    assert leaders["layers.5.attn"] == "layers.2.attn"
    assert leaders["layers.9.attn"] == "layers.6.attn"
    assert leaders["layers.77.attn"] == "layers.74.attn"
    # a shared layer's spec is never followed by an indexer spec of its own
    names = [s.name for s in shape.specs]
    assert "layers.3.indexer" not in names and names.index("layers.6.indexer") == (
        names.index("layers.6.attn") + 1
    )


def test_indexer_schedule_rule_pattern_and_leading_shared_layer():
    # offset 0: layer 0 would be shared with nothing to borrow from -> made full
    assert indexer_schedule(8, index_topk_freq=4, index_skip_topk_offset=0) == [
        True, False, False, True, False, False, False, True,
    ]  # fmt: skip
    assert indexer_schedule(6, index_topk_freq=2, index_skip_topk_offset=2) == [
        True, True, False, True, False, True,
    ]  # fmt: skip
    assert indexer_schedule(4, index_topk_pattern="FSSF") == [True, False, False, True]
    assert indexer_schedule(3, index_topk_pattern="SSF") == [True, False, True]
    assert indexer_schedule(3, indexer_types=["full", "shared", "full"]) == [True, False, True]
    # explicit indexer_types win over the pattern (transformers' precedence)
    assert indexer_schedule(2, indexer_types=["full", "full"], index_topk_pattern="FS") == [
        True,
        True,
    ]
    with pytest.raises(HiSparseConfigError, match="has 3 entries but the model has 4 layers"):
        indexer_schedule(4, index_topk_pattern="FSS")
    with pytest.raises(HiSparseConfigError, match="expected 'F'/'full' or 'S'/'shared'"):
        indexer_schedule(2, index_topk_pattern="FX")


# -- GPU groups --------------------------------------------------------------------------------


def _glm16_specs():
    """A 16-layer GLM-5 (IndexShare: 6 indexer layers): index-group pages of 4 layers are
    larger than the indexer page, the shape one indexer page per block padded most."""
    return cache_shape_from_hf_config(
        {"model_type": "glm_moe_dsa", "num_hidden_layers": 16, "index_topk_freq": 4,
         "index_skip_topk_offset": 3}
    ).specs  # fmt: skip


PACKING_SHAPES = {
    "deepseek-v3.2": lambda: deepseek_v32_cache_shape().specs,
    "glm-5": lambda: glm5_cache_shape().specs,
    "glm-5-bf16": lambda: glm5_cache_shape(kv_format="bf16").specs,
    "glm-16": _glm16_specs,
    # a unit (index group of 6 bf16 layers) larger than the single indexer page
    "oversized-unit": lambda: _tiny_specs(
        [True, True, False, False, False, False, False, True],
        block_size=64,
        fmt=RowFormat.BF16_MLA,
    ),
}


def _used_bytes(layout, specs, ctx):
    """Bytes one request's pages take, from the specs alone (no block padding)."""
    pages = math.ceil(ctx / layout.block_size)
    idx = sum(s.page_bytes for s in specs if s.kind is CacheKind.INDEXER)
    kv = sum(s.page_bytes for s in specs if s.kind is CacheKind.SPARSE)
    if layout.placement == "gpu":
        return pages * (idx + kv)
    return pages * idx + (min(3, pages) + layout.hot_blocks_per_request) * kv


@pytest.mark.parametrize("shape", PACKING_SHAPES)
def test_group_packing(shape):
    specs = PACKING_SHAPES[shape]()
    layout = _plan(specs)
    by_name = {s.name: s for s in specs}
    block = layout.gpu_bytes_per_block
    (indexer,) = layout.groups(GroupKind.INDEXER)
    assert indexer.layers == tuple(s.name for s in specs if s.kind is CacheKind.INDEXER)
    # the block is a whole number of indexer pages: the indexer group pads nothing
    assert block == indexer.pages_per_block * indexer.page_bytes
    resident, hot = layout.groups(GroupKind.RESIDENT), layout.groups(GroupKind.HOT)
    assert len(resident) == len(hot) >= 1
    # order: indexer, all resident, all hot
    assert [g.kind for g in layout.gpu_groups] == (
        [GroupKind.INDEXER] + [GroupKind.RESIDENT] * len(resident) + [GroupKind.HOT] * len(hot)
    )
    # every sparse layer exactly once, in layer order inside each pack
    names = [n for g in resident for n in g.layers]
    assert sorted(names) == sorted(s.name for s in specs if s.kind is CacheKind.SPARSE)
    order = {s.name: i for i, s in enumerate(specs)}
    for g in resident:
        assert [order[n] for n in g.layers] == sorted(order[n] for n in g.layers)
    group_of = {n: i for i, g in enumerate(resident) for n in g.layers}
    for unit in layout.index_groups:
        assert len({group_of[n] for n in unit.layers}) == 1, f"{unit.leader}'s unit was split"
    for res, h in zip(resident, hot, strict=True):
        assert res.layers == h.layers and res.layer_offsets == h.layer_offsets
        assert res.page_bytes == h.page_bytes == sum(by_name[n].page_bytes for n in res.layers)
        assert res.pages_per_block == h.pages_per_block == 1
        assert res.page_bytes <= block  # every pack fits a block
    # first fit: no two packs would have fitted one block together
    for a, b in itertools.combinations(resident, 2):
        assert a.page_bytes + b.page_bytes > block
    # a request of max_model_len pads under 5% of its blocks (the byte bound's 95%)
    used, held = layout.gpu_bytes_per_request(131072)
    assert used == _used_bytes(layout, specs, 131072)
    assert held == layout.gpu_blocks_per_request(131072) * block
    assert used / held >= 0.95


def test_indexer_pages_per_block_is_the_cheapest():
    """Of every block of m indexer pages that holds the largest index group, the plan takes
    the one whose max_model_len request holds the fewest bytes."""
    specs = _glm16_specs()
    layout = _plan(specs)
    m = layout.indexer_pages_per_block
    page = layout.groups(GroupKind.INDEXER)[0].page_bytes
    held = layout.gpu_bytes_per_request(131072)[1]
    unit = max(sum(s.page_bytes for s in specs if s.name in u.layers) for u in layout.index_groups)
    assert m > 1 and (m - 1) * page >= unit  # a smaller block would have held the unit...
    units = [[s for s in specs if s.name in u.layers] for u in layout.index_groups]
    for other in range(math.ceil(unit / page), 3 * m):
        packs = pack(units, other * page)
        blocks = math.ceil(2048 / other) + len(packs) * (3 + layout.hot_blocks_per_request)
        assert blocks * other * page >= held, f"{other} indexer pages per block are cheaper"


def test_first_fit_decreasing_packs_whole_units():
    specs = _glm16_specs()
    units = [[s for s in specs if s.name in u.layers] for u in _plan(specs).index_groups]
    sizes = [sum(s.page_bytes for s in u) for u in units]  # 1, 1, 4, 4, 4, 2 layers
    packs = pack(units, 2 * sizes[2])
    # largest first: two four-layer units fill a pack; the third takes the two-layer unit
    # and both single layers, which layer order alone would have split over three packs
    assert [[s.name for s in p] for p in packs] == [
        ["layers.0.attn", "layers.1.attn", "layers.10.attn", "layers.11.attn", "layers.12.attn",
         "layers.13.attn", "layers.14.attn", "layers.15.attn"],
        [f"layers.{i}.attn" for i in range(2, 10)],
    ]  # fmt: skip
    # a unit larger than the limit is a pack of its own, never split
    assert [len(p) for p in pack(units, sizes[2] - 1)] == [3, 1, 4, 4, 4]


def test_oversized_unit_sets_the_block():
    specs = _tiny_specs(
        [True, True, False, False, False, False, False, True], block_size=64, fmt=RowFormat.BF16_MLA
    )
    layout = _plan(specs)
    (indexer,) = layout.groups(GroupKind.INDEXER)
    # the six-layer unit is larger than the three indexer pages: the block takes enough
    # indexer pages to hold it
    assert layout.gpu_bytes_per_block >= 6 * 1152 * 64
    assert layout.gpu_bytes_per_block == indexer.pages_per_block * 3 * 132 * 64


def test_byte_bound_reached_on_real_and_small_shapes():
    """Requests that fit against the byte bound (all-GPU bytes per request over HiSparse
    bytes per request, padding not counted): >= 90% for the real shapes, the 16-layer GLM-5
    and the small checkpoints' shapes (issue #22)."""
    shapes = {
        "deepseek-v3.2": (deepseek_v32_cache_shape().specs, 60, 131072),
        "glm-5": (glm5_cache_shape().specs, 60, 131072),
        "glm-16": (_glm16_specs(), 60, 131072),
    }
    for arch in ("deepseek_v32", "glm_moe_dsa"):
        for layers in (2, 4):
            cfg = {"model_type": arch, "num_hidden_layers": layers}
            shapes[f"{arch}-{layers}"] = (cache_shape_from_hf_config(cfg).specs, 3, 131072)
    for name, (specs, gib, ctx) in shapes.items():
        hisparse = _plan(specs, gpu_gib=gib, max_len=ctx)
        baseline = _plan(specs, gpu_gib=gib, max_len=ctx, placement="gpu")
        bound = _used_bytes(baseline, specs, ctx) / _used_bytes(hisparse, specs, ctx)
        ratio = hisparse.max_requests(ctx) / baseline.max_requests(ctx)
        assert ratio >= 0.9 * bound, f"{name}: {ratio:.2f}x of a {bound:.2f}x bound"


def test_gpu_placement_has_no_hot_groups_and_no_host_pool():
    specs = deepseek_v32_cache_shape().specs
    layout = _plan(specs, placement="gpu")
    assert not layout.groups(GroupKind.HOT)
    assert layout.host_num_blocks == 0 and layout.host_pool_bytes == 0 and not layout.host_views
    assert layout.host_blocks_per_request(1000) == 0
    # one resident group holds every layer, indexer included: blocks are filled exactly
    (group,) = layout.gpu_groups
    assert group.kind is GroupKind.RESIDENT and len(group.layers) == 2 * 61
    assert layout.gpu_bytes_per_block == 61 * (656 + 132) * 64
    assert set(layout.gpu_views) == {s.name for s in specs}


# -- host layout through real tensors -----------------------------------------------------------


def test_host_views_tile_the_pool_token_major():
    # groups: [0], [1, 2, 3], [4, 5]
    layout = _tiny_plan([True, True, False, False, True, False])
    raw = torch.zeros(layout.host_pool_bytes, dtype=torch.uint8)
    for name in layout.host_views:
        layout.host_views[name].view(raw).add_(1)
    assert torch.equal(raw, torch.ones_like(raw)), "layer views overlap or leave gaps"

    assert [u.layers for u in layout.index_groups] == [
        ("layers.0.attn",),
        ("layers.1.attn", "layers.2.attn", "layers.3.attn"),
        ("layers.4.attn", "layers.5.attn"),
    ]
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (layout.host_pool_bytes,), dtype=torch.uint8, generator=gen)
    base = raw.data_ptr()
    for unit in layout.index_groups:
        views = [layout.host_views[n].view(raw) for n in unit.layers]
        row = unit.row_bytes[0]
        for block in range(layout.host_num_blocks):
            for token in range(layout.block_size):
                start = views[0][block, token].data_ptr() - base
                assert start == block * layout.host_block_bytes + unit.host_offset + (
                    token * unit.token_bytes
                )
                span = raw[start : start + unit.token_bytes]
                # one contiguous span holds the token's rows of the whole group, in order
                expected = torch.cat([v[block, token] for v in views])
                assert torch.equal(span, expected)
                for j, v in enumerate(views):
                    assert v[block, token].data_ptr() - base == start + j * row


def test_single_layer_groups_are_layer_major_pages():
    layout = _tiny_plan([True] * 3)
    for unit in layout.index_groups:
        (name,) = unit.layers
        spec = layout.host_views[name]
        assert spec.row_stride == spec.row_bytes == 656
        assert spec.page_is_contiguous


def test_gpu_views_overlay_groups_and_separate_layers_within_a_group():
    layout = _tiny_plan([True, True, False, False, True, False])
    raw = torch.zeros(layout.gpu_pool_bytes, dtype=torch.uint8)
    for group in layout.gpu_groups:
        raw.zero_()
        for name in group.layers:
            layout.gpu_views[name].view(raw).add_(1)
        assert int(raw.max()) == 1, f"layers of {group.kind} group overlap"
        # m pages of a group side by side from byte 0 of a block, every block alike
        covered = group.pages_per_block * group.page_bytes
        assert int(raw.view(layout.gpu_num_blocks, -1)[:, :covered].min()) == 1
        assert group.layer_offsets[0] == 0
    # a layer's resident and hot rows share one view
    for res, hot in zip(
        layout.groups(GroupKind.RESIDENT), layout.groups(GroupKind.HOT), strict=True
    ):
        for name in hot.layers:
            assert layout.gpu_views[name].offset == res.layer_offsets[res.layers.index(name)]
    # indexer pages are sub-blocks: page id b * m + i is page i of block b
    (indexer,) = layout.groups(GroupKind.INDEXER)
    m = indexer.pages_per_block
    assert m > 1 and layout.gpu_bytes_per_block == m * indexer.page_bytes
    idx = layout.gpu_views["layers.0.indexer"]
    assert idx.block_stride == indexer.page_bytes and idx.row_bytes == 132
    pages = idx.page_view(raw)
    assert pages.shape == (layout.gpu_num_blocks * m, 4 * 132)
    base = raw.data_ptr()
    for block, i in ((1, 0), (1, m - 1), (layout.gpu_num_blocks - 1, 1)):
        start = pages[block * m + i].data_ptr() - base
        assert start == block * layout.gpu_bytes_per_block + i * indexer.page_bytes


def test_paged_view_rejects_wrong_pools():
    spec = PagedViewSpec(
        offset=0, block_stride=64, row_stride=16, row_bytes=16, num_blocks=2, block_size=4
    )
    assert spec.view(torch.zeros(128, dtype=torch.uint8)).shape == (2, 4, 16)
    with pytest.raises(ValueError, match="uint8"):
        spec.view(torch.zeros(128, dtype=torch.float32))
    with pytest.raises(ValueError, match="reaches 128 bytes"):
        spec.view(torch.zeros(100, dtype=torch.uint8))
    sub = torch.zeros(256, dtype=torch.uint8)[128:]
    spec.view(sub)[1, 3].fill_(7)
    assert int(sub[64 + 48]) == 7 and int(sub.sum()) == 7 * 16


# -- capacity ----------------------------------------------------------------------------------


def test_deepseek_capacity_from_first_principles():
    """60 GiB GPU, 1024 GiB host, 131072 tokens, fp8_ds_mla rows, 2048-row hot buffer."""
    layers, row, key_row, bs, ctx = 61, 656, 128 + 4, 64, 131072
    pages = ctx // bs  # 2048
    indexer_page = layers * key_row * bs  # all 61 indexer pages side by side
    hot_blocks = 2 * 2048 // bs  # (max_query_len + 1) * top_k rows
    # A block of m indexer pages holds 12 * m sparse pages: with m < 5 the 61 layers take
    # several packs, each holding 3 tail pages and a hot region, and every m > 5 only pads
    # the indexer's last block more. m = 5: one pack of every layer.
    m = math.ceil(layers * row / (indexer_page / bs))
    block = m * indexer_page
    assert layers * row * bs <= block < layers * row * bs + indexer_page
    # the prefill staging area (outside the pool): one context + one step's 2048 prompt
    # tokens of one layer's rows
    staging = (ctx + 2048) * row
    gpu_blocks = (60 * GIB - staging) // block
    # tail: 2 pages, 3 at the peak (a decode step adds the next page before trimming)
    hisparse_gpu = math.ceil(pages / m) + 3 + hot_blocks
    host_block = layers * row * bs
    host_blocks = 1024 * GIB // host_block
    host_per_request = pages + 1
    expect_hisparse = min((gpu_blocks - 1) // hisparse_gpu, (host_blocks - 1) // host_per_request)
    gpu_block = layers * (row + key_row) * bs  # all-GPU: one group, every layer per block
    expect_gpu = (60 * GIB // gpu_block - 1) // pages

    specs = deepseek_v32_cache_shape().specs
    layout = _plan(specs)
    assert layout.indexer_pages_per_block == m == 5
    assert len(layout.groups(GroupKind.RESIDENT)) == 1
    assert layout.gpu_bytes_per_block == block == 2_576_640
    assert layout.gpu_num_blocks == gpu_blocks
    assert layout.host_block_bytes == host_block and layout.host_num_blocks == host_blocks
    assert layout.staging_bytes == staging
    assert layout.gpu_blocks_per_request(ctx) == hisparse_gpu == 477
    assert layout.host_blocks_per_request(ctx) == host_per_request
    assert layout.max_requests(ctx) == expect_hisparse == 52
    assert layout.max_requests_host(ctx) == 209
    baseline = _plan(specs, placement="gpu")
    assert baseline.gpu_blocks_per_request(ctx) == 2048
    assert baseline.max_requests(ctx) == expect_gpu == 10
    # a short request holds one indexer block and fewer tail pages than two
    assert layout.gpu_blocks_per_request(10) == 1 + 1 + hot_blocks
    assert layout.gpu_blocks_per_request(6 * bs) == 2 + 3 + hot_blocks


def test_describe_and_compact_names():
    layout = _plan(glm5_cache_shape().specs)
    text = layout.describe()
    assert "layers.[0-2,6-74 by 4].indexer" in text and "x 19 per block" in text
    assert "layers.0-77.attn" in text
    assert compact_layer_names([f"layers.{i}.attn" for i in range(12)]) == "layers.0-11.attn"
    assert isinstance(layout, KVLayout)
    assert layout.groups_table(4096).row_count == len(layout.gpu_groups) + 1  # + the total


# -- validation messages -----------------------------------------------------------------------


def test_unaligned_sparse_row():
    specs = [
        LayerCacheSpec("layers.0.attn", CacheKind.SPARSE, 650, 64, index_leader=None),
        indexer_spec("layers.0.indexer", block_size=64),
    ]
    with pytest.raises(HiSparseConfigError, match=r"multiple of 16 bytes \(pad it to 656\)"):
        _plan(specs, max_len=4096)


def test_mixed_block_sizes():
    specs = [
        sparse_mla_spec("layers.0.attn", block_size=64),
        indexer_spec("layers.0.indexer", block_size=32),
    ]
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, max_len=4096)
    msg = str(err.value)
    assert "one block size" in msg and "block_size 32: layers.0.indexer" in msg
    assert "Build every spec with block_size=64" in msg


def test_block_size_differs_from_config():
    specs = dsa_cache_specs([True, True], block_size=32)
    with pytest.raises(HiSparseConfigError, match=r"set HiSparseConfig\(block_size=32\)"):
        _plan(specs, max_len=4096)


def test_first_spec_must_be_sparse_mla():
    specs = [
        indexer_spec("layers.0.indexer", block_size=64),
        sparse_mla_spec("layers.0.attn", block_size=64),
    ]
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, max_len=4096)
    assert (
        "HiSparse requires the model's first cache group to be sparse MLA; got "
        "layers.0.indexer (indexer)" in str(err.value)
    )
    assert "placement='gpu'" in str(err.value)
    _plan(specs, max_len=4096, placement="gpu")  # the all-GPU baseline runs it


def test_no_indexer_specs():
    specs = [sparse_mla_spec(f"layers.{i}.attn", block_size=64) for i in range(2)]
    with pytest.raises(HiSparseConfigError, match="Add an indexer spec"):
        _plan(specs, max_len=4096)


def test_host_pool_too_small_says_how_many_gib():
    specs = deepseek_v32_cache_shape().specs
    need = (131072 // 64 + 2) * 61 * 656 * 64
    gib = math.ceil(need * 100 / GIB) / 100  # 4.89
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, host_gib=4.0)
    msg = str(err.value)
    assert f"Set host_pool_gib >= {gib:.2f} GiB" in msg and "2050" in msg
    _plan(specs, host_gib=gib)  # and that is indeed enough


def test_gpu_budget_smaller_than_one_block():
    specs = deepseek_v32_cache_shape().specs
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, gpu_gib=0.0005)
    msg = str(err.value)
    # two blocks beside the 0.08 GiB prefill staging area
    assert "holds no usable block" in msg and "Give the KV cache >= 0.09 GiB" in msg


def test_gpu_budget_smaller_than_one_max_len_request():
    specs = deepseek_v32_cache_shape().specs
    need = (477 + 1) * 2_576_640 + (131072 + 2048) * 656  # + the prefill staging area
    gib = math.ceil(need * 100 / GIB) / 100  # 1.23
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, gpu_gib=1.0)
    msg = str(err.value)
    assert f"Give the KV cache >= {gib:.2f} GiB" in msg and "max_model_len=131072" in msg
    assert "device_buffer_size" in msg
    _plan(specs, gpu_gib=gib)


def test_index_leader_must_be_an_earlier_sparse_layer():
    specs = [
        sparse_mla_spec("layers.0.attn", block_size=64, index_leader="layers.1.attn"),
        indexer_spec("layers.0.indexer", block_size=64),
        sparse_mla_spec("layers.1.attn", block_size=64),
    ]
    with pytest.raises(HiSparseConfigError) as err:
        _plan(specs, max_len=4096)
    assert "index_leader='layers.1.attn', which is not an earlier sparse MLA layer" in str(
        err.value
    )
    assert "Set index_leader to an earlier sparse layer" in str(err.value)
    specs[0] = sparse_mla_spec("layers.0.attn", block_size=64, index_leader="layers.0.indexer")
    with pytest.raises(HiSparseConfigError, match="not an earlier sparse MLA layer"):
        _plan(specs, max_len=4096)


def test_index_group_must_be_consecutive():
    specs = [
        sparse_mla_spec("layers.0.attn", block_size=64),
        indexer_spec("layers.0.indexer", block_size=64),
        sparse_mla_spec("layers.1.attn", block_size=64),
        indexer_spec("layers.1.indexer", block_size=64),
        sparse_mla_spec("layers.2.attn", block_size=64, index_leader="layers.0.attn"),
    ]
    with pytest.raises(HiSparseConfigError, match=r"index_leader='layers\.1\.attn'"):
        _plan(specs, max_len=4096)


def test_host_pool_past_int32_rows_is_refused():
    """Rows are int32 in every kernel: a host pool with 2**31 rows or more is refused with
    the largest size that works, which then plans."""
    specs = _tiny_specs([True])
    row = sum(s.row_bytes for s in specs if s.kind is CacheKind.SPARSE)
    with pytest.raises(HiSparseConfigError, match=r"int32.*host_pool_gib <= ") as err:
        _plan(specs, host_gib=2**31 * row / GIB, block_size=4, max_len=64)
    fit = float(str(err.value).rsplit("<= ", 1)[1].rstrip("."))
    assert _plan(specs, host_gib=fit, block_size=4, max_len=64).host_num_blocks * 4 < 2**31


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_blocks_keep_rows_16_byte_aligned(block_size):
    """68-byte indexer rows make an indexer page a multiple of 16 B only for some block
    sizes: the block takes a number of indexer pages that keeps every sparse row aligned."""
    specs = dsa_cache_specs(
        [True] * 3, block_size=block_size, kv_format="bf16", kv_lora_rank=128, rope_dim=16,
        index_head_dim=64,
    )  # fmt: skip
    config = HiSparseConfig(top_k=4, host_pool_gib=0.01, block_size=block_size).resolve()
    layout = plan_kv_layout(specs, config, 2**22, 64)
    assert layout.gpu_bytes_per_block % 16 == 0
    for spec in specs:
        if spec.kind is CacheKind.SPARSE:
            view = layout.gpu_views[spec.name]
            assert view.offset % 16 == view.block_stride % 16 == view.row_stride % 16 == 0
