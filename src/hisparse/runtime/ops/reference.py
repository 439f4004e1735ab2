"""Plain-PyTorch reference of the HiSparse data-plane ops: the oracle for every kernel.

Contracts: docs/design.md §6. Caches are paged uint8 views ``[num_blocks, block_size, row_bytes]``
(any strides); a physical row ``r`` of such a view is ``view[r // block_size, r % block_size]``.
Block tables and indices are int32, ``lru`` is int16. These functions run on any device; they
are written for clarity and per-request vectorisation, not for speed, and they do synchronise
with the host (the Triton kernels do not).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

#: The reference reads device values on the host (it synchronises): no graph capture.
CUDA_GRAPH_CAPTURABLE = False
#: Every op runs as written here: the oracle takes no fast path.
CPU_DECODE_FAST_PATH = False


def _rows(view: Tensor, rows: Tensor) -> Tensor:
    bs = view.shape[1]
    return view[rows // bs, rows % bs]


def _set_rows(view: Tensor, rows: Tensor, values: Tensor) -> None:
    bs = view.shape[1]
    view[rows // bs, rows % bs] = values


def _first_appearance_unique(values: Tensor) -> Tensor:
    """Distinct values of a 1-D tensor in order of first appearance."""
    if values.numel() == 0:
        return values
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((uniq.numel(),), values.numel(), dtype=torch.long, device=values.device)
    first.scatter_reduce_(
        0, inverse, torch.arange(values.numel(), device=values.device), reduce="amin"
    )
    return uniq[torch.argsort(first)]


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
    """Map logical top-k positions to physical rows; assign misses to LRU hot slots.

    Args:
        topk: ``[R, K]`` logical token positions, ``-1`` for none.
        row_req: ``[R]`` batch index ``q`` of each row (``< 0``: padding row).
        request_state_indices: ``[Q]`` hot-state slot of each request (``< 0``: padding).
        source_block_table: ``[Q, NB]`` host block ids.
        resident_block_table: ``[Q, NB]`` GPU block ids of resident pages (0 = not resident).
        hot_block_table: ``[S, HB]`` GPU block ids of each state slot's hot region.
        hot_index, lru: ``[S, H]`` hot state, updated in place.
        out_physical: ``[R, K]`` physical rows for attention (written, ``-1`` kept).
        swap_src, swap_dst, swap_count: ``[Q, H]``, ``[Q, H]``, ``[Q]`` the compact swap list
            (host row -> hot physical row) of each request, ascending by host row; entries
            past the count are untouched.
        valid_counts: ``[R]`` non-negative entries per row.
        hit_miss: ``[Q, 2]`` hits and misses over each request's wanted set.
        max_rows_per_request: most rows one request brings (lets kernels size their work);
            more is an error.
    """
    bs = block_size
    H = hot_index.shape[1]
    num_rows = topk.shape[0]
    out_physical[:num_rows].fill_(-1)
    if valid_counts is not None:
        valid_counts[:num_rows].zero_()
    swap_count.zero_()
    if hit_miss is not None:
        hit_miss.zero_()
    for q in range(request_state_indices.shape[0]):
        s = int(request_state_indices[q])
        if s < 0:
            continue
        rows = torch.nonzero(row_req[:num_rows] == q).flatten()
        if rows.numel() == 0:
            continue
        if max_rows_per_request is not None and rows.numel() > max_rows_per_request:
            raise ValueError(
                f"request {q} brings {rows.numel()} rows, more than max_rows_per_request="
                f"{max_rows_per_request} (HiSparseConfig.max_query_len: speculative tokens + 1)"
            )
        pos = topk[rows].long()  # [r, K]
        valid = pos >= 0
        p = pos.clamp_min(0)
        blk = p // bs
        host_row = source_block_table[q].long()[blk] * bs + p % bs
        out = torch.full_like(pos, -1)
        if resident_block_table is not None:
            res_blk = resident_block_table[q].long()[blk]
            resident = valid & (res_blk != 0)
            out = torch.where(resident, res_blk * bs + p % bs, out)
        else:
            resident = torch.zeros_like(valid)
        needs_hot = valid & ~resident
        if valid_counts is not None:
            valid_counts[rows] = valid.sum(1).to(valid_counts.dtype)
        wanted = _first_appearance_unique(host_row[needs_hot])
        if wanted.numel() > H:
            raise ValueError(
                f"request {q} wants {wanted.numel()} distinct host rows in one step but its hot "
                f"buffer holds {H}; device_buffer_size must be >= max_query_len * top_k."
            )
        if wanted.numel() == 0:
            out_physical[rows] = out.to(out_physical.dtype)
            continue
        slots = hot_index[s].long()
        order = lru[s].long()
        # Which slot (if any) holds each wanted row.
        sorted_vals, sorted_slots = torch.sort(slots)
        at = torch.searchsorted(sorted_vals, wanted).clamp_max(H - 1)
        is_hit = sorted_vals[at] == wanted
        hit_slot = sorted_slots[at]
        slot_is_hit = torch.zeros(H, dtype=torch.bool, device=slots.device)
        slot_is_hit[hit_slot[is_hit]] = True
        evictable = order[~slot_is_hit[order]]
        misses = wanted[~is_hit]
        n_miss = misses.numel()
        filled = evictable[:n_miss]
        hot_index[s, filled] = misses.to(hot_index.dtype)
        new_order = torch.cat([evictable[n_miss:], filled, order[slot_is_hit[order]]])
        lru[s] = new_order.to(lru.dtype)
        # Physical rows of hot slots.
        hot_bt = hot_block_table[s].long()
        slot_of_wanted = hit_slot.clone()
        slot_of_wanted[~is_hit] = filled
        phys_of_wanted = hot_bt[slot_of_wanted // bs] * bs + slot_of_wanted % bs
        # The swap list goes out in host-address order: adjacent rows become one read.
        by_addr = torch.argsort(misses)
        swap_src[q, :n_miss] = misses[by_addr].to(swap_src.dtype)
        swap_dst[q, :n_miss] = phys_of_wanted[~is_hit][by_addr].to(swap_dst.dtype)
        swap_count[q] = n_miss
        if hit_miss is not None:
            hit_miss[q, 0] = int(is_hit.sum())
            hit_miss[q, 1] = n_miss
        # Entries that need the hot buffer read their wanted row's slot.
        wanted_sorted, perm = torch.sort(wanted)
        idx = perm[torch.searchsorted(wanted_sorted, host_row[needs_hot])]
        out[needs_hot] = phys_of_wanted[idx]
        out_physical[rows] = out.to(out_physical.dtype)


def gather_compact(
    host: Tensor, device: Tensor, swap_src: Tensor, swap_dst: Tensor, swap_count: Tensor
) -> None:
    """Copy each request's first ``swap_count[q]`` listed rows from ``host`` into ``device``."""
    H = swap_src.shape[1]
    live = torch.arange(H, device=swap_count.device)[None, :] < swap_count[:, None].long()
    if not bool(live.any()):
        return
    src = swap_src[live].long().to(host.device)
    dst = swap_dst[live].long().to(device.device)
    _set_rows(device, dst, _rows(host, src).to(device.device))


def gather_compact_group(
    host_span: Tensor,
    devices: list[Tensor],
    swap_src: Tensor,
    swap_dst: Tensor,
    swap_count: Tensor,
) -> None:
    """`gather_compact` for every layer of an index group from one token-major host span.

    ``host_span`` is ``[NB, BS, G * row_bytes]``: token ``t``'s rows of the group's ``G``
    layers side by side (docs/design.md §4.1); bytes ``[j * row_bytes, (j + 1) * row_bytes)`` of a
    span are layer ``j``'s row and go to ``devices[j]`` (``[NBd, BS, row_bytes]``). The kernel
    reads each span once; the oracle simply gathers layer by layer.
    """
    G = len(devices)
    if G == 0:
        return
    rb = devices[0].shape[2]
    if host_span.shape[2] != G * rb:
        raise ValueError(
            f"host span holds {host_span.shape[2]} B per token, expected {G} layers x {rb} B"
        )
    for j, dev in enumerate(devices):
        gather_compact(host_span[:, :, j * rb : (j + 1) * rb], dev, swap_src, swap_dst, swap_count)


def gather_plan(
    src: Tensor, dst: Tensor, src_rows: Tensor, dst_rows: Tensor, mask: Tensor | None
) -> None:
    """Copy ``src`` row ``src_rows[i]`` to ``dst`` row ``dst_rows[i]`` where ``mask[i] != 0``
    (``mask=None``: where both rows are ``>= 0``, as a step's host mirror wants)."""
    if mask is None:
        n = min(src_rows.numel(), dst_rows.numel())
        mask = (src_rows.reshape(-1)[:n] >= 0) & (dst_rows.reshape(-1)[:n].to(src_rows.device) >= 0)
    live = (mask.reshape(-1) != 0).to(src_rows.device)
    s = src_rows.reshape(-1)[live].long().to(src.device)
    d = dst_rows.reshape(-1)[live].long().to(dst.device)
    if s.numel():
        _set_rows(dst, d, _rows(src, s).to(dst.device))


def invalidate_written_slots(
    hot_index: Tensor, request_state_indices: Tensor, row_req: Tensor, written_rows: Tensor
) -> None:
    """Empty (-1) every hot slot of the writing request that holds a just-written host row."""
    n = min(row_req.numel(), written_rows.numel())
    reqs = row_req[:n].long()
    rows = written_rows[:n].long()
    for q in torch.unique(reqs[(reqs >= 0) & (rows >= 0)]).tolist():
        s = int(request_state_indices[q])
        if s < 0:
            continue
        mine = rows[(reqs == q) & (rows >= 0)].to(hot_index.device)
        hot_index[s].masked_fill_(torch.isin(hot_index[s].long(), mine), -1)


def resident_rows(
    topk: Tensor,
    row_req: Tensor,
    resident_block_table: Tensor,
    block_size: int,
    out_physical: Tensor,
    valid_counts: Tensor | None = None,
) -> None:
    """Physical rows of ``topk [R, K]`` through the resident block table alone, where every
    page a row names is resident (an all-GPU cache): ``out_physical[:R]`` gets
    ``table[row_req, pos // block_size] * block_size + pos % block_size``, ``-1`` for ``-1``
    entries, padding rows (``row_req < 0``) and pages that are not resident (block 0);
    ``valid_counts[:R]`` the rows' non-negative entries."""
    rows = topk.shape[0]
    pos = topk.long().clamp_min(0)
    req = row_req[:rows].long()
    table = resident_block_table.long()
    blk = table[req.clamp_min(0)[:, None], pos // block_size]
    live = (topk >= 0) & (req >= 0)[:, None]
    phys = torch.where(live & (blk > 0), blk * block_size + pos % block_size, -1)
    out_physical[:rows].copy_(phys.to(out_physical.dtype))
    if valid_counts is not None:
        valid_counts[:rows].copy_((phys >= 0).sum(1).to(valid_counts.dtype))


def scatter_rows(values: Tensor, region: Tensor, slots: Tensor) -> None:
    """Row ``i`` of ``values [N, row_bytes]`` into ``region [blocks, block_size, row_bytes]``
    at row ``slots[i]`` (``block * block_size + offset``) where ``slots[i] >= 0``: a step's new
    rows into their pages, with no host sync (`write_rows_where`)."""
    from hisparse.kv.row_formats import write_rows_where

    write_rows_where(region, slots, values)
