"""The CPU batch-1 decode fast paths of the runtime (`CpuGroupDecode.finish_one`, the
compiled `decode_one`) against the general path with the reference ops, step by step on
one evolving state: the written host rows, the hot rows, the hot state, the counters and the
physical rows (poisoned before each step) must be equal byte for byte. With numba and
without it (the numpy form)."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.config import HiSparseConfig, cdiv
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.ops import cpu_backend, reference
from hisparse.runtime.sparse_layer import SparseLayerRuntime
from hisparse.testing.ops_cases import POISON

BS, TOP_K, HOT, LAYERS, W, PAGES = 4, 6, 12, 3, 32, 10


def _set_jit(enabled: bool) -> None:
    cpu_backend().jit_enabled = enabled


def _twin(ops: object, eager_mirror: bool, seed: int) -> tuple[list[CacheHandle], list, list]:
    """An index group of ``LAYERS`` layers (token-major host span, one device pool) with
    ``ops``; the same bytes for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    config = HiSparseConfig(
        top_k=TOP_K, block_size=BS, device_buffer_size=HOT, max_query_len=1,
        host_pool_gib=0.001, eager_host_mirror=eager_mirror,
    ).resolve()  # fmt: skip
    hb = cdiv(HOT, BS)
    nh, nd = 1 + PAGES, 1 + hb + PAGES
    host_all = torch.randint(0, 256, (nh, BS, LAYERS, W), dtype=torch.uint8, generator=g)
    dev_all = torch.randint(0, 256, (nd, LAYERS, BS, W), dtype=torch.uint8, generator=g)
    handles, hosts, devs = [], [], []
    for li in range(LAYERS):
        rt = SparseLayerRuntime(
            f"layer{li}", config, row_bytes=W, max_num_reqs=2, device="cpu",
            index_group=handles[0].runtime.group if handles else None,
        )  # fmt: skip
        rt.bind_host(host_all[:, :, li])
        rt.bind_device(dev_all[:, li])
        handles.append(CacheHandle(rt))
        hosts.append(host_all[:, :, li])
        devs.append(dev_all[:, li])
    CacheHandle.link_index_group(handles)
    group = handles[0].runtime.group
    group.ops = ops
    # slot 1 is the request's; hot blocks 1..hb (slot 0 gets the same, unused)
    group.bind_hot_block_table(torch.tensor([list(range(1, hb + 1))] * 2, dtype=torch.int32))
    return handles, hosts, devs


def _state(handles: list[CacheHandle], hosts: list, devs: list) -> list[torch.Tensor]:
    group = handles[0].runtime.group
    names = ("hot_index", "lru", "totals", "swap_count", "hit_miss", "valid_counts")
    return [getattr(group, n).clone() for n in names] + [t.clone() for t in hosts + devs]


@pytest.fixture(params=["jit", "numpy"])
def jit_mode(request: pytest.FixtureRequest):
    if request.param == "jit" and cpu_backend().jit() is None:
        pytest.skip("numba is not installed (or HISPARSE_CPU_JIT=0)")
    _set_jit(request.param == "jit")
    yield request.param
    _set_jit(True)


@pytest.mark.parametrize("eager_mirror", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_batch1_decode_steps_equal_the_general_path(
    seed: int, eager_mirror: bool, jit_mode: str
) -> None:
    rng = random.Random(seed)
    fast = _twin(cpu_backend(), eager_mirror, seed)
    slow = _twin(reference, eager_mirror, seed)
    assert all(torch.equal(a, b) for a, b in zip(_state(*fast), _state(*slow), strict=True))
    hb = cdiv(HOT, BS)
    host_blocks = list(range(1, PAGES + 1))
    rng.shuffle(host_blocks)
    src_bt = torch.tensor([[0] * PAGES, host_blocks], dtype=torch.int32)
    res_row = [0] * PAGES
    free_dev = list(range(1 + hb, 1 + hb + PAGES))
    length = 2 * BS
    for step in range(24):
        # a few pages become resident now and then (as the engine's reloads)
        if rng.random() < 0.2:
            page = rng.randrange(PAGES)
            if not res_row[page]:
                res_row[page] = free_dev.pop()
        res_bt = torch.tensor([[0] * PAGES, res_row], dtype=torch.int32)
        pos = min(length, PAGES * BS - 1)
        host_row = host_blocks[pos // BS] * BS + pos % BS
        held = [int(x) for x in fast[0][0].runtime.group.hot_index[1] if int(x) >= 0]
        kind = rng.random()
        if kind < 0.25 and held:
            host_row = rng.choice(held)  # rewrites a row a hot slot holds: must be dropped
        elif kind < 0.35:
            host_row = -1  # nothing to write
        dev_row = res_row[pos // BS] * BS + pos % BS if res_row[pos // BS] else -1
        if rng.random() < 0.5 or dev_row < 0:
            dev_row = rng.randrange((1 + hb) * BS, (1 + hb + PAGES) * BS)
        meta = StepMetadata(
            num_tokens=1, is_decode=True, req_per_token=torch.tensor([0], dtype=torch.int32),
            request_state_indices=torch.tensor([1], dtype=torch.int32),
            source_block_table=src_bt[1:].clone(),
            host_slot_mapping=torch.tensor([host_row], dtype=torch.int32),
        )  # fmt: skip
        tables = GroupTables(
            resident_block_table=res_bt[1:].clone(),
            slot_mapping=torch.tensor([dev_row], dtype=torch.int32),
        )
        k = rng.randint(1, TOP_K)
        topk = torch.tensor([[rng.randrange(-1, length + 1) for _ in range(k)]], dtype=torch.int32)
        new_rows = [torch.randint(0, 256, (W,), dtype=torch.uint8) for _ in range(LAYERS)]
        outs = []
        for handles, _hosts, _devs in (fast, slow):
            group = handles[0].runtime.group
            group.physical.fill_(POISON + step)
            handles[0].prepare_group_for_batch(meta, tables)
            physical = []
            for li, h in enumerate(handles):
                view, slots = h.write_target()
                r = int(slots[0])
                view[r // BS, r % BS] = new_rows[li]
                h.finish_kv_update()
                physical.append(h.swap_in(topk.clone()).clone())
            outs.append(physical)
        for a, b in zip(outs[0], outs[1], strict=True):
            assert torch.equal(a, b), f"step {step}: physical rows differ"
        for a, b in zip(_state(*fast), _state(*slow), strict=True):
            assert torch.equal(a, b), f"step {step}: state differs"
        length += 1


def test_the_fast_finish_path_is_taken(jit_mode: str) -> None:
    """The fast path serves a plain batch-1 decode step (it returns True), and declines a
    step of two tokens and a group on the reference ops."""
    handles, _hosts, _devs = _twin(cpu_backend(), True, 0)
    group = handles[0].runtime.group
    meta = StepMetadata(
        num_tokens=1, is_decode=True, req_per_token=torch.tensor([0], dtype=torch.int32),
        request_state_indices=torch.tensor([1], dtype=torch.int32),
        source_block_table=torch.arange(PAGES, dtype=torch.int32)[None],
        host_slot_mapping=torch.tensor([5], dtype=torch.int32),
    )  # fmt: skip
    tables = GroupTables(
        resident_block_table=torch.zeros((1, PAGES), dtype=torch.int32),
        slot_mapping=torch.tensor([(1 + cdiv(HOT, BS)) * BS], dtype=torch.int32),
    )
    handles[0].prepare_group_for_batch(meta, tables)
    assert group.cpu_one.finish_one(handles[1].runtime, meta, tables)
    two = StepMetadata(
        num_tokens=2, is_decode=True, req_per_token=torch.tensor([0, 0], dtype=torch.int32),
        request_state_indices=meta.request_state_indices,
        source_block_table=meta.source_block_table,
        host_slot_mapping=torch.tensor([5, 6], dtype=torch.int32),
    )  # fmt: skip
    assert not group.cpu_one.finish_one(handles[1].runtime, two, tables)
    group.ops = reference
    assert group.cpu_one is None  # the reference ops: no fast path to take


def test_the_fast_path_follows_the_group_ops() -> None:
    """`cpu_one` (the CPU backend's batch-1 path) is re-derived whenever the group's ops
    change: on for the CPU backend, off for the reference and for the swap timer's wrapper
    (it must see every op call)."""
    from hisparse.bench.swap_timer import SwapTimer

    handles, _hosts, _devs = _twin(cpu_backend(), True, 0)
    group = handles[0].runtime.group
    assert group.cpu_one is not None
    group.ops = reference
    assert group.cpu_one is None
    group.ops = cpu_backend()
    SwapTimer(torch.device("cpu")).wrap(group)
    assert group.ops is not cpu_backend() and group.cpu_one is None
