"""Hand-worked examples of the reference data-plane ops (docs/design.md §6)."""

import torch

from hisparse.runtime.ops import reference as ref

BS = 4


def _state(S: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((S, H), -1, dtype=torch.int32),
        torch.arange(H, dtype=torch.int16).repeat(S, 1),
    )


def _outputs(R: int, K: int, Q: int, H: int):
    return (
        torch.full((R, K), 12345, dtype=torch.int32),
        torch.full((Q, H), -7, dtype=torch.int32),
        torch.full((Q, H), -7, dtype=torch.int32),
        torch.full((Q,), 99, dtype=torch.int32),
    )


def test_resolve_hits_misses_lru_and_resident():
    H = 8
    hot_index, lru = _state(1, H)
    hot_bt = torch.tensor([[5, 6]], dtype=torch.int32)  # hot slots 0-3 -> block 5, 4-7 -> 6
    src_bt = torch.tensor([[10, 11, 12]], dtype=torch.int32)
    res_bt = torch.tensor([[0, 0, 7]], dtype=torch.int32)  # page 2 resident in GPU block 7
    state = torch.tensor([0], dtype=torch.int32)
    row_req = torch.tensor([0], dtype=torch.int32)
    # positions 1, 5, 1 (dup), -1, 9 (resident page 2, offset 1)
    topk = torch.tensor([[1, 5, 1, -1, 9]], dtype=torch.int32)
    out, src, dst, cnt = _outputs(1, 5, 1, H)
    valid = torch.full((1,), -3, dtype=torch.int32)
    hm = torch.full((1, 2), -3, dtype=torch.int32)
    ref.resolve_residency(
        topk,
        row_req,
        state,
        src_bt,
        res_bt,
        hot_bt,
        hot_index,
        lru,
        BS,
        out,
        src,
        dst,
        cnt,
        valid,
        hm,
    )
    # host rows: pos 1 -> 10*4+1 = 41, pos 5 -> 11*4+1 = 45. Slots 0, 1 filled.
    assert hot_index[0, :2].tolist() == [41, 45]
    assert out.tolist() == [[5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 0, -1, 7 * 4 + 1]]
    assert cnt.tolist() == [2]
    assert src[0, :2].tolist() == [41, 45] and dst[0, :2].tolist() == [20, 21]
    assert src[0, 2:].tolist() == [-7] * 6  # past the count: untouched
    assert lru[0].tolist() == [2, 3, 4, 5, 6, 7, 0, 1]
    assert valid.tolist() == [4] and hm.tolist() == [[0, 2]]

    # Second step: 45 hits, 46 (pos 6) misses -> takes slot 2, the oldest evictable.
    topk = torch.tensor([[6, 5, -1, -1, -1]], dtype=torch.int32)
    out, src, dst, cnt = _outputs(1, 5, 1, H)
    ref.resolve_residency(
        topk,
        row_req,
        state,
        src_bt,
        res_bt,
        hot_bt,
        hot_index,
        lru,
        BS,
        out,
        src,
        dst,
        cnt,
        None,
        hm,
    )
    assert hot_index[0, :3].tolist() == [41, 45, 46]
    assert out[0, :2].tolist() == [22, 21]
    # unused evictable (3..7, 0), then filled (2), then hits (1)
    assert lru[0].tolist() == [3, 4, 5, 6, 7, 0, 2, 1]
    assert hm.tolist() == [[1, 1]]


def test_padding_rows_and_empty_wanted_leave_state():
    H = 4
    hot_index, lru = _state(2, H)
    hot_index[1] = torch.tensor([3, -1, 8, -1])
    lru[1] = torch.tensor([2, 0, 3, 1])
    before = (hot_index.clone(), lru.clone())
    topk = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    row_req = torch.tensor([0, 1], dtype=torch.int32)
    state = torch.tensor([-1, 1], dtype=torch.int32)  # request 0 is padding
    res_bt = torch.tensor([[0], [9]], dtype=torch.int32)  # request 1: all resident
    out, src, dst, cnt = _outputs(2, 2, 2, H)
    ref.resolve_residency(
        topk,
        row_req,
        state,
        torch.tensor([[1], [2]], dtype=torch.int32),
        res_bt,
        torch.tensor([[1], [2]], dtype=torch.int32),
        hot_index,
        lru,
        BS,
        out,
        src,
        dst,
        cnt,
    )
    assert out.tolist() == [[-1, -1], [38, 39]]
    assert torch.equal(hot_index, before[0]) and torch.equal(lru, before[1])
    assert cnt.tolist() == [0, 0]


def test_gather_compact_and_plan_copy_whole_rows():
    host = torch.randint(0, 256, (4, BS, 32), dtype=torch.uint8)
    dev = torch.randint(0, 256, (3, BS, 32), dtype=torch.uint8)
    before = dev.clone()
    src = torch.tensor([[5, 14, 0], [2, 0, 0]], dtype=torch.int32)
    dst = torch.tensor([[4, 11, 0], [0, 0, 0]], dtype=torch.int32)
    ref.gather_compact(host, dev, src, dst, torch.tensor([2, 0], dtype=torch.int32))
    assert torch.equal(dev[1, 0], host[1, 1]) and torch.equal(dev[2, 3], host[3, 2])
    untouched = torch.ones(3, BS, dtype=torch.bool)
    untouched[1, 0] = untouched[2, 3] = False
    assert torch.equal(dev[untouched], before[untouched])
    ref.gather_plan(host, dev, torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert torch.equal(dev[0, 1], host[0, 2]) and torch.equal(dev[0, 0], before[0, 0])


def test_invalidate_written_slots_only_touches_the_writer():
    hot_index = torch.tensor([[4, 9, -1], [9, 4, 5]], dtype=torch.int32)
    ref.invalidate_written_slots(
        hot_index,
        torch.tensor([1, -1, 0], dtype=torch.int32),
        torch.tensor([0, 2, 1], dtype=torch.int32),
        torch.tensor([9, 5, 4], dtype=torch.int32),
    )
    # request 0 -> slot 1 wrote 9; request 2 -> slot 0 wrote 5; request 1 is padding.
    assert hot_index.tolist() == [[4, 9, -1], [-1, 4, 5]]
