"""The data-plane ops for CPU tensors: the reference's results, at a fraction of its overhead.

The reference (`reference.py`, the oracle) loops over requests and issues dozens of small
torch ops per request; on the CPU each costs microseconds of dispatch, and a decode step runs
every op once per layer. Here every op is a handful of whole-batch numpy operations on views
of the same memory (``Tensor.numpy()`` shares storage, so writes land in the tensors), with no
Python loop over requests and no host round trip through lists.

Outputs and state equal the reference's bit for bit on every input the reference accepts.
Inputs it rejects (too many rows or wanted rows per request, positions past the block table,
two live requests on one hot-state slot, negative host rows, non-CPU tensors) are handed to
the reference itself, so the same error is raised after the same partial updates.
"""

from __future__ import annotations

import numpy as np
import torch

from hisparse.runtime.ops import reference

Tensor = torch.Tensor

__all__ = [
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
    "resolve_residency",
]


def _on_cpu(*tensors: Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _np(t: Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (writes go to the tensor)."""
    return t.detach().numpy()


def _row_view(view: Tensor) -> np.ndarray:
    """A paged ``[NB, BS, W]`` view as ``[NB * BS, W]`` rows (a view where strides allow)."""
    a = _np(view)
    nb, bs, w = a.shape
    s0, s1, s2 = a.strides
    if s0 == bs * s1 or nb <= 1:
        return np.lib.stride_tricks.as_strided(a, (nb * bs, w), (s1, s2), writeable=True)
    return a.reshape(nb * bs, w)  # a copy: only for reading


def _put_rows(dst: Tensor, rows: np.ndarray, values: np.ndarray) -> None:
    """``dst`` row ``rows[i]`` = ``values[i]`` (the paged view written in place)."""
    d = _np(dst)
    nb, bs, _ = d.shape
    if d.strides[0] == bs * d.strides[1] or nb <= 1:
        _row_view(dst)[rows] = values
    else:
        d[rows // bs, rows % bs] = values


def _copy_rows(src: Tensor, dst: Tensor, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
    """``dst`` row ``dst_rows[i]`` = ``src`` row ``src_rows[i]`` (all read before any write)."""
    if src_rows.size:
        _put_rows(dst, dst_rows, np.take(_row_view(src), src_rows, axis=0))


def _swap_entries(
    swap_src: Tensor, swap_dst: Tensor, swap_count: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """(host rows, hot rows) of every request's first ``swap_count[q]`` swap-list entries."""
    count = _np(swap_count).astype(np.int64)
    H = swap_src.shape[1]
    live = np.arange(H)[None, :] < count[:, None]
    return (
        _np(swap_src)[live].astype(np.int64),
        _np(swap_dst)[live].astype(np.int64),
    )


def gather_compact(
    host: Tensor, device: Tensor, swap_src: Tensor, swap_dst: Tensor, swap_count: Tensor
) -> None:
    """Copy each request's first ``swap_count[q]`` listed rows from ``host`` into ``device``."""
    if not _on_cpu(host, device, swap_src, swap_dst, swap_count):
        reference.gather_compact(host, device, swap_src, swap_dst, swap_count)
        return
    src, dst = _swap_entries(swap_src, swap_dst, swap_count)
    _copy_rows(host, device, src, dst)


def gather_compact_group(
    host_span: Tensor,
    devices: list[Tensor],
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
) -> None:
    """`gather_compact` for a group's layers: one read of each token's span, split by layer."""
    G = len(devices)
    if G == 0:
        return
    rb = devices[0].shape[2]
    if host_span.shape[2] != G * rb:
        raise ValueError(
            f"host span holds {host_span.shape[2]} B per token, expected {G} layers x {rb} B"
        )
    if not _on_cpu(host_span, swap_src, swap_dst, swap_count, *devices):
        reference.gather_compact_group(host_span, devices, swap_src, swap_dst, swap_count)
        return
    src, dst = _swap_entries(swap_src, swap_dst, swap_count)
    if src.size == 0:
        return
    spans = np.take(_row_view(host_span), src, axis=0)
    for j, dev in enumerate(devices):
        _put_rows(dev, dst, spans[:, j * rb : (j + 1) * rb])


def gather_plan(src: Tensor, dst: Tensor, src_rows: Tensor, dst_rows: Tensor, mask: Tensor) -> None:
    """Copy ``src`` row ``src_rows[i]`` to ``dst`` row ``dst_rows[i]`` where ``mask[i] != 0``."""
    if not _on_cpu(src, dst, src_rows, dst_rows, mask):
        reference.gather_plan(src, dst, src_rows, dst_rows, mask)
        return
    live = _np(mask).reshape(-1) != 0
    s = _np(src_rows).reshape(-1)[live].astype(np.int64)
    d = _np(dst_rows).reshape(-1)[live].astype(np.int64)
    _copy_rows(src, dst, s, d)


def invalidate_written_slots(
    hot_index: Tensor, request_state_indices: Tensor, row_req: Tensor, written_rows: Tensor
) -> None:
    """Empty (-1) every hot slot of the writing request that holds a just-written host row."""
    if not _on_cpu(hot_index, request_state_indices, row_req, written_rows):
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    n = min(row_req.numel(), written_rows.numel())
    reqs = _np(row_req)[:n].astype(np.int64)
    rows = _np(written_rows)[:n].astype(np.int64)
    keep = (reqs >= 0) & (rows >= 0)
    if not keep.any():
        return
    reqs, rows = reqs[keep], rows[keep]
    state = _np(request_state_indices)
    if int(reqs.max()) >= state.shape[0]:  # the reference raises an IndexError
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    slots = state[reqs].astype(np.int64)
    mine = slots >= 0
    if not mine.any():
        return
    slots, rows = slots[mine], rows[mine]
    hot = _np(hot_index)
    if int(slots.max()) >= hot.shape[0]:  # the reference raises an IndexError
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    touched, which = np.unique(slots, return_inverse=True)
    sub = hot[touched].astype(np.int64)  # [n_touched, H]
    # Match (slot, row) pairs through one key; -1 entries never match (rows >= 0).
    span = int(max(int(sub.max()), int(rows.max()))) + 1
    hot_keys = np.arange(touched.size, dtype=np.int64)[:, None] * span + sub
    hot_keys[sub < 0] = -1
    stale = np.isin(hot_keys, which.astype(np.int64) * span + rows)
    if stale.any():
        sub[stale] = -1
        hot[touched] = sub


def resolve_residency(
    topk: Tensor,
    row_req: Tensor,
    request_state_indices: Tensor,
    source_block_table: Tensor,
    resident_block_table: Tensor | None,
    hot_block_table: Tensor,
    hot_index: Tensor,
    lru: Tensor,
    block_size: int,
    out_physical: Tensor,
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
    valid_counts: Tensor | None = None,
    hit_miss: Tensor | None = None,
    *,
    max_rows_per_request: int | None = None,
) -> None:
    """`reference.resolve_residency` for the whole batch at once (same contract, same bits).

    Every request's entries are handled together: the wanted sets are the distinct
    (request, host row) keys in order of first appearance, hits are found by one sorted
    search over the touched slots' hot rows, and each slot's new LRU order is a scatter of
    its old order (evictable slots rotated by the miss count, then the hit slots).
    """
    args = (
        topk, row_req, request_state_indices, source_block_table, resident_block_table,
        hot_block_table, hot_index, lru, block_size, out_physical, swap_src, swap_dst,
        swap_count, valid_counts, hit_miss,
    )  # fmt: skip

    def oracle() -> None:
        reference.resolve_residency(*args, max_rows_per_request=max_rows_per_request)

    if not _on_cpu(*[a for a in args if isinstance(a, Tensor)]):
        oracle()
        return
    bs = int(block_size)
    S, H = hot_index.shape
    R, K = topk.shape
    Q = request_state_indices.shape[0]
    state = _np(request_state_indices).astype(np.int64)
    rq = np.full(R, -1, dtype=np.int64)
    n_req_rows = min(R, row_req.shape[0])
    rq[:n_req_rows] = _np(row_req)[:n_req_rows]
    live = (rq >= 0) & (rq < Q)
    live[live] = state[rq[live]] >= 0
    live_rows = np.flatnonzero(live)
    q_of_row = rq[live_rows]

    out = _np(out_physical)
    out[:R] = -1
    vc = None if valid_counts is None else _np(valid_counts)
    if vc is not None:
        vc[:R] = 0
    _np(swap_count)[...] = 0
    hm = None if hit_miss is None else _np(hit_miss)
    if hm is not None:
        hm[...] = 0
    if live_rows.size == 0:
        return

    # Inputs the reference rejects: let it raise (after the same partial updates).
    rows_per_req = np.bincount(q_of_row, minlength=Q)
    reqs = np.flatnonzero(rows_per_req)
    slots_of_reqs = state[reqs]
    if (
        (max_rows_per_request is not None and int(rows_per_req.max()) > max_rows_per_request)
        or int(slots_of_reqs.max()) >= S
        or np.unique(slots_of_reqs).size != slots_of_reqs.size
    ):
        oracle()
        return

    pos = _np(topk)[live_rows].astype(np.int64)  # [r, K]
    valid = pos >= 0
    p = np.maximum(pos, 0)
    blk = p // bs
    off = p - blk * bs
    src_bt = _np(source_block_table)
    if K and int(blk.max()) >= src_bt.shape[1]:
        oracle()
        return
    qq = q_of_row[:, None]
    host_row = src_bt[qq, blk].astype(np.int64) * bs + off
    if resident_block_table is not None:
        res_blk = _np(resident_block_table)[qq, blk].astype(np.int64)
        resident = valid & (res_blk != 0)
        phys = np.where(resident, res_blk * bs + off, -1)
        needs_hot = valid & ~resident
    else:
        phys = np.full(pos.shape, -1, dtype=np.int64)
        needs_hot = valid
    if vc is not None:
        vc[live_rows] = valid.sum(1)

    entries = np.flatnonzero(needs_hot)  # row-major: rows in order, entries in order
    if entries.size == 0:
        out[live_rows] = phys
        return
    e_q = q_of_row[entries // K] if K else q_of_row[:0]
    e_g = host_row.reshape(-1)[entries]
    if int(e_g.min()) < 0:
        oracle()
        return
    # Wanted sets: distinct (request, host row) keys; unique() sorts by key, so by request
    # and then by host row (the swap list's order), and returns each key's first entry.
    hot = _np(hot_index)
    span = int(e_g.max()) + 1
    keys, first, inverse = np.unique(e_q * span + e_g, return_index=True, return_inverse=True)
    u_q = keys // span
    u_g = keys - u_q * span
    wanted_per_req = np.bincount(u_q, minlength=Q)
    if int(wanted_per_req.max()) > H:
        oracle()
        return
    # The touched slots (one per request that wants rows), ranked in request order.
    t_reqs = np.flatnonzero(wanted_per_req)
    t_slots = state[t_reqs]
    rank_of_req = np.zeros(Q, dtype=np.int64)
    rank_of_req[t_reqs] = np.arange(t_reqs.size)
    u_rank = rank_of_req[u_q]
    n_t = t_reqs.size

    # Hits: search each wanted key among the touched slots' held rows.
    held = hot[t_slots].astype(np.int64)  # [n_t, H]
    held_keys = (np.arange(n_t, dtype=np.int64)[:, None] * span + held).reshape(-1)
    held_keys[((held < 0) | (held >= span)).reshape(-1)] = -1  # never wanted: no key
    by_key = np.argsort(held_keys, kind="stable")
    sorted_keys = held_keys[by_key]
    at = np.minimum(np.searchsorted(sorted_keys, u_rank * span + u_g), sorted_keys.size - 1)
    is_hit = sorted_keys[at] == u_rank * span + u_g
    hit_slot = by_key[at] - u_rank * H  # slot within the row (valid where is_hit)

    hit_mask = np.zeros((n_t, H), dtype=bool)
    hit_mask[u_rank[is_hit], hit_slot[is_hit]] = True
    order = _np(lru)[t_slots].astype(np.int64)  # [n_t, H] oldest first
    hit_in_order = np.take_along_axis(hit_mask, order, 1)
    evictable = ~hit_in_order
    ev_rank = np.cumsum(evictable, 1) - 1
    hit_rank = np.cumsum(hit_in_order, 1) - 1
    n_ev = evictable.sum(1)
    is_miss = ~is_hit
    n_miss = np.bincount(u_rank[is_miss], minlength=n_t)
    # New order: evictable slots past the misses, the slots just filled, then the hits.
    new_at = np.where(
        evictable,
        (ev_rank - n_miss[:, None]) % np.maximum(n_ev, 1)[:, None],
        n_ev[:, None] + hit_rank,
    )
    new_order = np.empty_like(order)
    np.put_along_axis(new_order, new_at, order, 1)

    # Misses, in wanted-set order (first appearance) per request, take the oldest evictables.
    wanted_order = np.argsort(u_rank * entries.size + first, kind="stable")
    miss_w = wanted_order[is_miss[wanted_order]]  # unique ids of misses, wanted order
    miss_rank = u_rank[miss_w]
    miss_start = np.cumsum(n_miss) - n_miss
    nth_miss = np.arange(miss_w.size) - miss_start[miss_rank]
    filled = np.full((n_t, H), -1, dtype=np.int64)
    takes = evictable & (ev_rank < n_miss[:, None])
    filled[np.nonzero(takes)[0], ev_rank[takes]] = order[takes]
    slot_of_u = hit_slot.copy()
    slot_of_u[miss_w] = filled[miss_rank, nth_miss]

    # State: the misses' rows into their slots, the new LRU order.
    hot[t_slots[miss_rank], slot_of_u[miss_w]] = u_g[miss_w]
    _np(lru)[t_slots] = new_order

    # Physical rows of the slots; every entry that needs the hot buffer reads its row's.
    hot_bt = _np(hot_block_table)
    u_slot_s = t_slots[u_rank]
    phys_of_u = hot_bt[u_slot_s, slot_of_u // bs].astype(np.int64) * bs + slot_of_u % bs
    phys.reshape(-1)[entries] = phys_of_u[inverse.reshape(-1)]
    out[live_rows] = phys

    # Swap lists in host-row order (the unique keys' order), counts, hit/miss counters.
    miss_u = np.flatnonzero(is_miss)
    mq = u_q[miss_u]
    col = np.arange(miss_u.size) - miss_start[rank_of_req[mq]]
    _np(swap_src)[mq, col] = u_g[miss_u]
    _np(swap_dst)[mq, col] = phys_of_u[miss_u]
    _np(swap_count)[t_reqs] = n_miss
    if hm is not None:
        hm[t_reqs, 0] = wanted_per_req[t_reqs] - n_miss
        hm[t_reqs, 1] = n_miss
