"""Block pool accounting and the single host backing."""

import pytest
import torch

from hisparse.kv.block_pool import NULL_BLOCK, BlockPool, BlockPoolExhausted
from hisparse.kv.host_pool import HostPool, HostPoolError, check_host_memory


def test_null_block_never_allocated_and_freed_blocks_reused_first():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert NULL_BLOCK not in a and a == [1, 2, 3]
    with pytest.raises(BlockPoolExhausted, match="1 blocks wanted, 0 free of 3"):
        pool.allocate(1)
    pool.free([a[0]])
    assert pool.allocate(1) == [a[0]]
    pool.free([a[1]])
    pool.free([a[2]])
    assert pool.allocate(1) == [a[2]]  # the most recently freed first: memory stays warm


def test_refcounts_keep_shared_blocks_alive():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.free([b]) == [] and pool.ref_count(b) == 1
    assert pool.free([b]) == [b] and pool.num_free == 2
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([b])
    with pytest.raises(ValueError, match="not allocatable"):
        pool.free([NULL_BLOCK])


def test_free_many_keeps_order_and_earlier_releases_on_a_bad_id():
    pool = BlockPool(8)
    a = pool.allocate(7)
    pool.incref([a[2]])
    assert pool.free(a[:4]) == [a[0], a[1], a[3]]  # a[2] still shared
    assert pool.allocate(3) == [a[0], a[1], a[3]]  # reused first, in the order freed
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[4], a[5], a[5], a[6]])
    assert pool.num_free == 2 and pool.ref_count(a[6]) == 1  # a[4], a[5] freed; a[6] not
    assert pool.allocate(2) == [a[4], a[5]]


def test_failed_allocation_takes_nothing():
    pool = BlockPool(5)
    pool.allocate(2)
    with pytest.raises(BlockPoolExhausted):
        pool.allocate(3)
    assert pool.num_free == 2


def test_host_pool_is_one_per_process_and_released_deterministically():
    with HostPool(4096, pin=False) as pool:
        assert pool.backing.numel() == 4096 and pool.backing.dtype == torch.uint8
        with pytest.raises(HostPoolError, match="already exists"):
            HostPool(4096, pin=False)
    with pytest.raises(HostPoolError, match="closed"):
        _ = pool.backing
    HostPool(4096, pin=False).close()  # the slot is free again


def test_host_pool_refuses_more_than_available_memory():
    with pytest.raises(HostPoolError, match=r"set host_pool_gib <= 0\.95"):
        check_host_memory(2 * 2**30, available=2**30)
    check_host_memory(2**29, available=2**30)
