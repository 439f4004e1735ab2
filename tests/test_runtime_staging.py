"""Prefill staging rows (property test) and the runtime's errors on inputs past its limits."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.config import HiSparseConfig
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.sparse_layer import SparseLayerRuntime
from hisparse.runtime.staging import PrefillStagingPlan
from hisparse.testing.cache_model import int32s

# ------------------------------------------------------------------------------------------
# Prefill staging
# ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    bs=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    num_reqs=st.integers(1, 4),
    pages=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_prefill_staging_rows(bs: int, layers: int, num_reqs: int, pages: int, seed: int) -> None:
    """Every staged row is the resident copy where the page is resident, else the host row."""
    rng = random.Random(seed)
    W = 16
    num_host = rng.randint(2, 10)
    num_dev = 1 + num_host
    cfg = HiSparseConfig(
        top_k=1, block_size=bs, device_buffer_size=2, host_pool_gib=0.001
    ).resolve()
    # Which host blocks are resident (dirty: the resident copy differs from the host row).
    resident_of = {b: (b if rng.random() < 0.4 else 0) for b in range(1, num_host)}
    src_bt, res_bt, ctx = [], [], []
    for _ in range(num_reqs):
        c = rng.randint(0, pages)
        row = [rng.choice([*range(1, num_host), 0]) if rng.random() < 0.9 else 0 for _ in range(c)]
        row += [rng.randint(0, num_host - 1) for _ in range(pages - c)]  # past context
        src_bt.append(row)
        res_bt.append(
            [
                resident_of.get(b, 0) if i < c else rng.randint(0, num_dev - 1)
                for i, b in enumerate(row)
            ]
        )
        ctx.append(c)
    host_bytes = [rng.randbytes(num_host * bs * W) for _ in range(layers)]
    dev_bytes = [rng.randbytes(num_dev * bs * W) for _ in range(layers)]
    runtimes: list[SparseLayerRuntime] = []
    for li in range(layers):
        rt = SparseLayerRuntime(
            f"l{li}",
            cfg,
            row_bytes=W,
            max_num_reqs=num_reqs,
            device="cpu",
            index_group=runtimes[0].group if runtimes else None,
        )
        rt.bind_host(
            torch.frombuffer(bytearray(host_bytes[li]), dtype=torch.uint8).reshape(num_host, bs, W)
        )
        rt.bind_device(
            torch.frombuffer(bytearray(dev_bytes[li]), dtype=torch.uint8).reshape(num_dev, bs, W)
        )
        runtimes.append(rt)
    handles = [CacheHandle(rt) for rt in runtimes]
    CacheHandle.link_index_group(handles)
    meta = StepMetadata(
        num_tokens=0,
        is_decode=False,
        req_per_token=torch.zeros(0, dtype=torch.int32),
        request_state_indices=int32s(list(range(num_reqs))),
        source_block_table=int32s(src_bt),
        host_slot_mapping=None,
    )
    tables = GroupTables(
        resident_block_table=int32s(res_bt), slot_mapping=torch.zeros(0, dtype=torch.int32)
    )
    handles[0].prepare_group_for_batch(meta, tables)
    plan = PrefillStagingPlan.build(int32s(src_bt), int32s(ctx), bs)

    used = {src_bt[q][i] for q in range(num_reqs) for i in range(ctx[q]) if src_bt[q][i] > 0}
    assert plan.num_blocks == len(used)
    staging_of: dict[int, int] = {}
    for q in range(num_reqs):
        for i in range(pages):
            b, got = src_bt[q][i], int(plan.block_table[q, i])
            if i >= ctx[q] or b == 0:
                assert got == -1, (q, i)
                continue
            assert 0 <= got < len(used)
            assert staging_of.setdefault(b, got) == got  # one staging block per host block
    assert len(set(staging_of.values())) == len(staging_of)

    for li, h in enumerate(handles):
        view, bt = h.prefill_cache(plan)
        assert torch.equal(bt, plan.block_table)
        assert tuple(view.shape) == (len(used), bs, W)
        staged = view.contiguous().numpy().tobytes()
        for b, sb in staging_of.items():
            for off in range(bs):
                r = resident_of[b]
                src = dev_bytes[li] if r else host_bytes[li]
                row = (r if r else b) * bs + off
                got = staged[(sb * bs + off) * W : (sb * bs + off + 1) * W]
                assert got == src[row * W : (row + 1) * W], (li, b, off)


# ------------------------------------------------------------------------------------------
# Capacity
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mql", [1, 2, 3])
def test_too_many_rows_is_a_clear_error(mql: int) -> None:
    """More rows than max_num_reqs * max_query_len: ValueError naming max_query_len."""
    cfg = HiSparseConfig(
        top_k=2, block_size=2, device_buffer_size=2 * mql, max_query_len=mql, host_pool_gib=0.001
    ).resolve()
    rt = SparseLayerRuntime("l0", cfg, row_bytes=16, max_num_reqs=2, device="cpu")
    rt.bind_host(torch.zeros((4, 2, 16), dtype=torch.uint8))
    rt.bind_device(torch.zeros((8, 2, 16), dtype=torch.uint8))
    h = CacheHandle(rt)
    rows = 2 * mql + 1
    meta = StepMetadata(
        num_tokens=rows,
        is_decode=True,
        req_per_token=torch.zeros(rows, dtype=torch.int32),
        request_state_indices=int32s([0, 1]),
        source_block_table=torch.ones((2, 2), dtype=torch.int32),
        host_slot_mapping=torch.full((rows,), -1, dtype=torch.int32),
    )
    tables = GroupTables(
        resident_block_table=torch.zeros((2, 2), dtype=torch.int32),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int32),
    )
    h.prepare_group_for_batch(meta, tables)
    with pytest.raises(ValueError, match="max_query_len"):
        h.swap_in(torch.zeros((rows, 2), dtype=torch.int32))
    # Exactly at capacity (max_query_len rows for each request) is fine.
    ok = torch.full((2 * mql, 2), -1, dtype=torch.int32)
    meta.req_per_token = int32s([0] * mql + [1] * mql)
    meta.num_tokens = 2 * mql
    assert h.swap_in(ok).shape == (2 * mql, 2)
    # One request bringing more than max_query_len rows could want more rows than its hot
    # buffer holds: refused, naming the setting.
    meta.req_per_token = int32s([0] * (mql + 1) + [1] * (mql - 1))
    with pytest.raises(ValueError, match="max_rows_per_request"):
        h.swap_in(ok)
