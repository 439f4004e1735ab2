"""The runtime's errors on inputs past its limits."""

from __future__ import annotations

import pytest
import torch

from hisparse.config import HiSparseConfig
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.sparse_layer import SparseLayerRuntime
from hisparse.testing.cache_model import int32s


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
