"""The data-plane ops for CPU tensors: the reference's results, at a fraction of its overhead.

The reference (`reference.py`, the oracle) loops over requests and issues dozens of small
torch ops per request; on the CPU each costs microseconds of dispatch, and a decode step runs
every op once per layer. Here each op is a short run of whole-batch numpy operations on views
of the same memory (``Tensor.numpy()`` shares storage, so writes land in the tensors), with no
Python loop over requests and no host round trip through lists. Batches of one query row or
one written row (every batch-1 decode step) take a shorter form on 1-D arrays and scalars: in
a decode step each numpy call costs a few microseconds, so the count of calls is the cost.

Outputs and state equal the reference's bit for bit on every input the reference accepts
whose hot state is valid (docs/design.md §7: no host row twice in one slot set, ``lru`` a
permutation). Inputs it rejects (too many rows or wanted rows per request, positions past
the block table, requests or state slots out of range, negative host rows), two live requests
on one hot-state slot (which it resolves one after the other) and non-CPU tensors are handed
to the reference itself: the same result, or the same error after the same partial updates.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from hisparse.runtime.ops import reference

Tensor = torch.Tensor

__all__ = [
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
    "resident_rows",
    "resolve_residency",
    "scatter_rows",
]

#: A lookup of a few torch ops (`CacheHandle.resident_rows` compiles the CPU prefill's).
resident_rows = reference.resident_rows
#: Rows written by torch indexing (`write_rows_fast` writes the CPU's with plain indexing).
scatter_rows = reference.scatter_rows


def _on_cpu(*tensors: Tensor | None) -> bool:
    return all(t is None or t.is_cpu for t in tensors)


def _np(t: Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (writes go to the tensor)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


#: numpy >= 2.1 can be told never to copy in a reshape (cheaper than `as_strided`).
_RESHAPE_HAS_COPY = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 1)


def _flat_rows(a: np.ndarray) -> np.ndarray | None:
    """A paged ``[NB, BS, W]`` array as ``[NB * BS, W]`` rows, or ``None`` where its strides
    do not allow a view (blocks not ``BS`` rows apart, e.g. one layer's pages in a shared pool).
    """
    nb, bs, w = a.shape
    if nb > 1 and a.strides[0] != bs * a.strides[1]:
        return None
    if _RESHAPE_HAS_COPY:  # copy=False: a view or an error, never a silent copy
        return np.reshape(a, (nb * bs, w), copy=False)
    return np.lib.stride_tricks.as_strided(a, (nb * bs, w), a.strides[1:], writeable=True)


def _take_rows(src: Tensor, rows: np.ndarray) -> np.ndarray:
    """``src`` rows ``rows`` as a new ``[n, W]`` array."""
    a = _np(src)
    flat = _flat_rows(a)
    if flat is not None:
        return np.take(flat, rows, axis=0)
    bs = a.shape[1]
    return a[rows // bs, rows % bs]


def _put_rows(dst: Tensor, rows: np.ndarray, values: np.ndarray) -> None:
    """``dst`` row ``rows[i]`` = ``values[i]`` (the paged view written in place)."""
    a = _np(dst)
    flat = _flat_rows(a)
    if flat is not None:
        flat[rows] = values
    else:
        bs = a.shape[1]
        a[rows // bs, rows % bs] = values


def _copy_rows(src: Tensor, dst: Tensor, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
    """``dst`` row ``dst_rows[i]`` = ``src`` row ``src_rows[i]`` (all read before any write)."""
    if src_rows.size:
        _put_rows(dst, dst_rows, _take_rows(src, src_rows))


def _swap_entries(
    swap_src: Tensor, swap_dst: Tensor, swap_count: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """(host rows, hot rows) of every request's first ``swap_count[q]`` swap-list entries."""
    if swap_count.shape[0] == 1 and swap_src.shape[0] == 1 and swap_dst.shape[0] == 1:
        # One request (batch 1): leading slices, no masks.
        n = max(int(_np(swap_count)[0]), 0)
        return _np(swap_src)[0, :n].astype(np.int64), _np(swap_dst)[0, :n].astype(np.int64)
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


def _row(a: np.ndarray, row: int) -> np.ndarray:
    """Row ``row`` of a paged ``[NB, BS, W]`` array (a view)."""
    bs = a.shape[1]
    return a[row // bs, row % bs]


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
    spans = _take_rows(host_span, src)
    for j, dev in enumerate(devices):
        _put_rows(dev, dst, spans[:, j * rb : (j + 1) * rb])


def gather_plan(
    src: Tensor, dst: Tensor, src_rows: Tensor, dst_rows: Tensor, mask: Tensor | None
) -> None:
    """Copy ``src`` row ``src_rows[i]`` to ``dst`` row ``dst_rows[i]`` where ``mask[i] != 0``
    (``mask=None``: where both rows are ``>= 0``)."""
    if mask is None:
        n = min(src_rows.numel(), dst_rows.numel())
        if not _on_cpu(src, dst, src_rows, dst_rows):
            reference.gather_plan(src, dst, src_rows, dst_rows, None)
            return
        s = _np(src_rows).reshape(-1)[:n]
        d = _np(dst_rows).reshape(-1)[:n]
        live = (s >= 0) & (d >= 0)
        if not live.all():
            s, d = s[live], d[live]
        _copy_rows(src, dst, s, d)
        return
    if not _on_cpu(src, dst, src_rows, dst_rows, mask):
        reference.gather_plan(src, dst, src_rows, dst_rows, mask)
        return
    if mask.numel() == 1 and src_rows.numel() == 1 and dst_rows.numel() == 1:
        # One entry (a batch-1 decode step's mirror): one row copy by scalar indices.
        if _np(mask).reshape(-1)[0]:
            d, s_ = int(_np(dst_rows).reshape(-1)[0]), int(_np(src_rows).reshape(-1)[0])
            _row(_np(dst), d)[...] = _row(_np(src), s_)
        return
    live = _np(mask).reshape(-1)
    s = _np(src_rows).reshape(-1)
    d = _np(dst_rows).reshape(-1)
    if live.dtype != np.bool_:
        live = live != 0
    if not live.all():
        s, d = s[live], d[live]
    _copy_rows(src, dst, s, d)


#: Up to this many (written row x hot slot) pairs, invalidation compares them all at once;
#: above it (long prefills), it matches sorted keys instead.
_INVALIDATE_BROADCAST_MAX = 1 << 16


def invalidate_written_slots(
    hot_index: Tensor, request_state_indices: Tensor, row_req: Tensor, written_rows: Tensor
) -> None:
    """Empty (-1) every hot slot of the writing request that holds a just-written host row."""
    if not _on_cpu(hot_index, request_state_indices, row_req, written_rows):
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    n = min(row_req.shape[0], written_rows.shape[0])
    if n == 1:  # one token written (a batch-1 decode step): scalars
        q, r = int(_np(row_req)[0]), int(_np(written_rows)[0])
        if q < 0 or r < 0:
            return
        state = _np(request_state_indices)
        if q >= state.shape[0] or int(state[q]) >= hot_index.shape[0]:
            reference.invalidate_written_slots(
                hot_index, request_state_indices, row_req, written_rows
            )  # it raises the IndexError
            return
        s = int(state[q])
        if s >= 0:
            held = _np(hot_index)[s]
            held[held == r] = -1
        return
    reqs = _np(row_req)[:n]
    rows = _np(written_rows)[:n]
    keep = (reqs >= 0) & (rows >= 0)
    if not keep.any():
        return
    reqs, rows = reqs[keep], rows[keep]
    state = _np(request_state_indices)
    hot = _np(hot_index)
    if int(reqs.max()) >= state.shape[0]:  # the reference raises an IndexError
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    slots = state[reqs]
    mine = slots >= 0
    if not mine.all():
        slots, rows = slots[mine], rows[mine]
        if slots.size == 0:
            return
    if int(slots.max()) >= hot.shape[0]:  # the reference raises an IndexError
        reference.invalidate_written_slots(hot_index, request_state_indices, row_req, written_rows)
        return
    H = hot.shape[1]
    if slots.size * H <= _INVALIDATE_BROADCAST_MAX:
        # Written entry e empties slot h of its state slot where that slot holds its row.
        e, h = np.nonzero(hot[slots] == rows[:, None])
        hot[slots[e], h] = -1
        return
    touched, which = np.unique(slots, return_inverse=True)
    sub = hot[touched].astype(np.int64)  # [n_touched, H]
    span = int(max(int(sub.max()), int(rows.max()))) + 1
    hot_keys = np.arange(touched.size, dtype=np.int64)[:, None] * span + sub
    hot_keys[sub < 0] = -1  # rows >= 0: an empty slot matches nothing
    stale = np.isin(hot_keys, which.astype(np.int64) * span + rows)
    if stale.any():
        sub[stale] = -1
        hot[touched] = sub


def _resolve_one_request(
    q: int,
    s: int,
    entries: np.ndarray,
    e_g: np.ndarray,
    phys: np.ndarray,
    hot_index: Tensor,
    lru: Tensor,
    hot_block_table: Tensor,
    bs: int,
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
    hm: np.ndarray | None,
) -> bool:
    """Rules 2-6 for request ``q`` (state slot ``s``) alone, whose entries ``entries`` (flat
    indices into ``phys``) need host rows ``e_g``; ``False`` (nothing written) if it wants
    more rows than its hot buffer holds."""
    H = hot_index.shape[1]
    keys, first, inverse = _unique_first(e_g)  # wanted rows, sorted (the swap list's order)
    U = keys.size
    if U > H:
        return False
    hot = _np(hot_index)[s]
    at = np.searchsorted(keys, hot)
    np.minimum(at, U - 1, out=at)
    hit_mask = keys[at] == hot  # slot holds a wanted row (-1 matches none: keys >= 0)
    hit_slots = np.flatnonzero(hit_mask)
    hit_u = at[hit_slots]
    is_miss = np.ones(U, dtype=bool)
    is_miss[hit_u] = False
    slot_of_u = np.empty(U, dtype=np.int64)
    slot_of_u[hit_u] = hit_slots
    lru_s = _np(lru)[s]
    order = lru_s.astype(np.int64)
    hit_in_order = hit_mask[order]
    evictable = order[~hit_in_order]
    miss_u = np.flatnonzero(is_miss)
    n_miss = miss_u.size
    # Misses in wanted-set order (first entry) take the oldest evictable slots.
    slot_of_u[miss_u[np.argsort(first[miss_u])]] = evictable[:n_miss]
    lru_s[:] = np.concatenate((evictable[n_miss:], evictable[:n_miss], order[hit_in_order]))
    hot[slot_of_u[miss_u]] = keys[miss_u]
    hot_bt = _np(hot_block_table)[s]
    phys_of_u = hot_bt[slot_of_u // bs].astype(np.int64) * bs + slot_of_u % bs
    phys.reshape(-1)[entries] = phys_of_u[inverse]
    _np(swap_src)[q, :n_miss] = keys[miss_u]
    _np(swap_dst)[q, :n_miss] = phys_of_u[miss_u]
    _np(swap_count)[q] = n_miss
    if hm is not None:
        hm[q, 0] = U - n_miss
        hm[q, 1] = n_miss
    return True


def _unique_first(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted distinct keys, index of each one's first occurrence, inverse map): what
    ``np.unique(..., return_index=True, return_inverse=True)`` gives, with less overhead."""
    perm = np.argsort(keys, kind="stable")
    ordered = keys[perm]
    new = np.empty(keys.size, dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(keys.size, dtype=np.int64)
    inverse[perm] = np.cumsum(new) - 1
    return ordered[new], perm[new], inverse


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
    one_request_path: bool = True,
    jit: Callable[[], SimpleNamespace | None] | None = None,
) -> None:
    """`reference.resolve_residency` for the whole batch at once (same contract, same bits).

    ``one_request_path``: a batch with one live request (every decode step at batch 1) takes
    `_resolve_one_request`, fewer and smaller ops than the batched form (which tests also run
    on such batches); with ``jit`` (`CpuBackend.jit`: the compiled kernels, or ``None``) one
    query row is one compiled call.

    Every request's entries are handled together: the wanted sets are the distinct
    (request, host row) keys, hits are found by searching the touched slots' held rows among
    those sorted keys, and each slot's new LRU order is a scatter of its old order
    (evictable slots rotated by the miss count, then the hit slots).
    """
    args = (
        topk, row_req, request_state_indices, source_block_table, resident_block_table,
        hot_block_table, hot_index, lru, block_size, out_physical, swap_src, swap_dst,
        swap_count, valid_counts, hit_miss,
    )  # fmt: skip

    def oracle() -> None:
        reference.resolve_residency(*args, max_rows_per_request=max_rows_per_request)

    if not _on_cpu(
        topk, row_req, request_state_indices, source_block_table, resident_block_table,
        hot_block_table, hot_index, lru, out_physical, swap_src, swap_dst, swap_count,
        valid_counts, hit_miss,
    ):  # fmt: skip
        oracle()
        return
    bs = int(block_size)
    S, H = hot_index.shape
    R, K = topk.shape
    Q = request_state_indices.shape[0]
    state = _np(request_state_indices)
    out = _np(out_physical)
    out[:R] = -1
    vc = None if valid_counts is None else _np(valid_counts)
    if vc is not None:
        vc[:R] = 0
    _np(swap_count)[...] = 0
    hm = None if hit_miss is None else _np(hit_miss)
    if hm is not None:
        hm[...] = 0

    if R == 1 and one_request_path and row_req.shape[0] >= 1:
        # One query row (a batch-1 decode step): scalars and 1-D arrays, fewer ops.
        q = int(_np(row_req)[0])
        if q < 0 or q >= Q or int(state[q]) < 0:
            return
        s = int(state[q])
        if s >= S or (max_rows_per_request is not None and max_rows_per_request < 1):
            oracle()
            return
        fns = None if jit is None else jit()
        if fns is not None and q < min(source_block_table.shape[0], swap_src.shape[0]):
            src_bt = _np(source_block_table)
            res_bt = src_bt if resident_block_table is None else _np(resident_block_table)
            if q >= res_bt.shape[0] or q >= swap_dst.shape[0]:
                oracle()
                return
            ok, n_valid, wanted, n_miss = fns.resolve_row(
                _np(topk)[0], src_bt[q], res_bt[q], resident_block_table is not None,
                _np(hot_block_table)[s], _np(hot_index)[s], _np(lru)[s], bs, out[0],
                _np(swap_src)[q], _np(swap_dst)[q],
            )  # fmt: skip
            if not ok:
                oracle()
                return
            if vc is not None:
                vc[0] = n_valid
            if wanted:
                _np(swap_count)[q] = n_miss
                if hm is not None:
                    hm[q, 0] = wanted - n_miss
                    hm[q, 1] = n_miss
            return
        pos = _np(topk)[0].astype(np.int64)
        valid = pos >= 0
        blk, off = np.divmod(np.maximum(pos, 0), bs)
        src_bt = _np(source_block_table)[q]
        if K and int(blk.max()) >= src_bt.shape[0]:
            oracle()
            return
        host_row = src_bt[blk].astype(np.int64) * bs + off
        if resident_block_table is not None:
            res_blk = _np(resident_block_table)[q][blk].astype(np.int64)
            resident = valid & (res_blk != 0)
            phys = np.where(resident, res_blk * bs + off, -1)
            needs_hot = valid & ~resident
        else:
            phys = np.full(K, -1, dtype=np.int64)
            needs_hot = valid
        if vc is not None:
            vc[0] = np.count_nonzero(valid)
        entries = np.flatnonzero(needs_hot)
        if entries.size:
            e_g = host_row[entries]
            if int(e_g.min()) < 0 or not _resolve_one_request(
                q, s, entries, e_g, phys, hot_index, lru, hot_block_table, bs,
                swap_src, swap_dst, swap_count, hm,
            ):  # fmt: skip
                oracle()
                return
        out[0] = phys
        return

    rq = _np(row_req)[:R].astype(np.int64)
    live = (rq >= 0) & (rq < Q)
    live[live] = state[rq[live]] >= 0
    live_rows = np.flatnonzero(live)
    if live_rows.size == 0:
        return
    q_of_row = rq[live_rows]

    # Inputs the reference rejects: let it raise (after the same partial updates).
    rows_per_req = np.bincount(q_of_row, minlength=Q)
    slots_of_reqs = state[rows_per_req > 0].astype(np.int64)
    if (
        (max_rows_per_request is not None and int(rows_per_req.max()) > max_rows_per_request)
        or int(slots_of_reqs.max()) >= S
        or (slots_of_reqs.size > 1 and int(np.bincount(slots_of_reqs).max()) > 1)
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
    e_g = host_row.reshape(-1)[entries]
    if int(e_g.min()) < 0:
        oracle()
        return
    if slots_of_reqs.size == 1 and one_request_path:
        q0 = int(q_of_row[0])
        if not _resolve_one_request(
            q0, int(state[q0]), entries, e_g, phys, hot_index, lru, hot_block_table, bs,
            swap_src, swap_dst, swap_count, hm,
        ):  # fmt: skip
            oracle()
            return
        out[live_rows] = phys
        return
    e_q = q_of_row[entries // K]
    # Wanted sets: distinct (request, host row) keys, sorted by request and then host row
    # (the swap list's order), with each key's first entry (the wanted-set order).
    span = int(e_g.max()) + 1
    keys, first, inverse = _unique_first(e_q * span + e_g)
    u_q = keys // span
    u_g = keys - u_q * span
    wanted_per_req = np.bincount(u_q, minlength=Q)
    if int(wanted_per_req.max()) > H:
        oracle()
        return
    # The touched slots (one per request that wants rows), ranked in request order.
    t_reqs = np.flatnonzero(wanted_per_req)
    t_slots = state[t_reqs]
    n_t = t_reqs.size
    rank_of_req = np.zeros(Q, dtype=np.int64)
    rank_of_req[t_reqs] = np.arange(n_t)
    u_rank = rank_of_req[u_q]

    # Hits: each held row of a touched slot searched among the sorted wanted keys.
    hot = _np(hot_index)
    held = hot[t_slots].astype(np.int64)  # [n_t, H]
    held_keys = t_reqs[:, None] * span + held
    held_keys[(held < 0) | (held >= span)] = -1  # never wanted: matches no key
    at = np.minimum(np.searchsorted(keys, held_keys), keys.size - 1)
    hit_mask = keys[at] == held_keys  # [n_t, H] slot holds a wanted row
    hit_u = at[hit_mask]
    is_hit = np.zeros(keys.size, dtype=bool)
    is_hit[hit_u] = True
    slot_of_u = np.empty(keys.size, dtype=np.int64)
    slot_of_u[hit_u] = np.nonzero(hit_mask)[1]

    # New LRU order: evictable slots past the misses, the slots just filled, then the hits.
    row_base = (np.arange(n_t, dtype=np.int64) * H)[:, None]
    order = _np(lru)[t_slots].astype(np.int64)  # [n_t, H] oldest first
    hit_in_order = hit_mask.reshape(-1)[order + row_base]
    evictable = ~hit_in_order
    ev_seen = np.cumsum(evictable, 1)  # evictable slots up to and including each position
    n_ev = ev_seen[:, -1:]
    is_miss = ~is_hit
    n_miss = np.bincount(u_rank[is_miss], minlength=n_t)
    ev_rank = ev_seen - 1
    new_at = np.where(
        evictable,
        (ev_rank - n_miss[:, None]) % np.maximum(n_ev, 1),
        n_ev + np.arange(H) - ev_seen,
    )
    new_order = np.empty(n_t * H, dtype=np.int64)
    new_order[new_at + row_base] = order

    # Misses in wanted-set order (request, then first entry) take the oldest evictables,
    # which np.nonzero lists in the same order (slot set, then LRU position).
    miss_u = np.flatnonzero(is_miss)  # key order: request, then host row
    by_first = miss_u[np.argsort(u_rank[miss_u] * entries.size + first[miss_u], kind="stable")]
    slot_of_u[by_first] = order[evictable & (ev_rank < n_miss[:, None])]

    # State: the misses' rows into their slots, the new LRU order.
    hot[t_slots[u_rank[miss_u]], slot_of_u[miss_u]] = u_g[miss_u]
    _np(lru)[t_slots] = new_order.reshape(n_t, H)

    # Physical rows of the slots; every entry that needs the hot buffer reads its row's.
    hot_bt = _np(hot_block_table)
    phys_of_u = hot_bt[t_slots[u_rank], slot_of_u // bs].astype(np.int64) * bs + slot_of_u % bs
    phys.reshape(-1)[entries] = phys_of_u[inverse]
    out[live_rows] = phys

    # Swap lists in host-row order (the keys' order), counts, hit/miss counters.
    mq = u_q[miss_u]
    miss_start = np.cumsum(n_miss) - n_miss
    col = np.arange(miss_u.size) - miss_start[u_rank[miss_u]]
    _np(swap_src)[mq, col] = u_g[miss_u]
    _np(swap_dst)[mq, col] = phys_of_u[miss_u]
    _np(swap_count)[t_reqs] = n_miss
    if hm is not None:
        hm[t_reqs, 0] = wanted_per_req[t_reqs] - n_miss
        hm[t_reqs, 1] = n_miss
