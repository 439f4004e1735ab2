"""The GQA indexer's compact key cache: writing each method's keys into the pages (fp8 bytes,
lowrank fp16 pairs, quest chunk bounds), reading a request's keys back, and the lowrank
method's choice of kept dims from the weights. Split from `gqa_indexer_reference` (the
methods, the config and the format `GqaIndexerFormat` that sizes these pages) so that the
cache's bytes read on their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hisparse.kv.row_formats import fp8_values

if TYPE_CHECKING:
    from hisparse.attention.gqa_indexer_reference import GqaIndexerFormat

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def rope_pair_dims(
    wq: torch.Tensor, wk: torch.Tensor, num_heads: int, num_kv_heads: int, pairs: int
) -> torch.Tensor:
    """``[G, 2·pairs]`` dims (ascending) of each KV head that the ``lowrank`` method keeps.

    Pair ``i`` (dims ``i``, ``i + D/2``) is ranked by ``Σ_{h in group} ‖W_q,h pair‖ · ‖W_k pair‖``,
    the scale of its contribution to ``q·k`` for unit-norm inputs.
    """
    g = num_kv_heads
    d = wk.shape[0] // g
    half = d // 2
    if not 0 < pairs <= half:
        raise ValueError(f"lowrank_pairs must be in 1..{half}; got {pairs}")
    q_rows = wq.float().view(num_heads, d, -1).pow(2).sum(-1)  # [H, D]
    k_rows = wk.float().view(g, d, -1).pow(2).sum(-1)  # [G, D]
    q_pair = (q_rows[:, :half] + q_rows[:, half:]).sqrt().view(g, num_heads // g, half).sum(1)
    k_pair = (k_rows[:, :half] + k_rows[:, half:]).sqrt()
    best = (q_pair * k_pair).topk(pairs, dim=-1).indices.sort(dim=-1).values  # [G, pairs]
    return torch.cat((best, best + half), dim=-1)


# ---------------------------------------------------------------------------------------------
# The compact key cache
# ---------------------------------------------------------------------------------------------
def write_index_keys(
    pages: torch.Tensor,
    fmt: GqaIndexerFormat,
    slots: torch.Tensor,
    k: torch.Tensor,
    dims: torch.Tensor | None = None,
    *,
    sync_free: bool = False,
) -> None:
    """Store keys ``k [N, G, D]`` (rotated) of the tokens at physical ``slots`` (``< 0`` skipped).

    quest: a token at the first position of its chunk restarts the chunk's bounds, later ones
    widen them; tokens of one step may share a chunk. ``sync_free`` (fp8 / lowrank): write
    with `write_rows_fast` (same bytes; off the CPU `write_rows_where`: no host read,
    CUDA-graph capturable).
    """
    fmt.block_size_of(pages)  # validates the page shape
    if sync_free and fmt.method != "quest":
        from hisparse.kv.row_formats import write_rows_fast

        kf = k.float()
        if fmt.method == "fp8":
            row = kf.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(1).view(torch.uint8)
        else:
            if dims is None:
                raise ValueError("lowrank index keys need the kept dims")
            picked = torch.gather(kf, 2, dims[None].expand(k.shape[0], -1, -1).to(k.device))
            row = picked.to(torch.float16).flatten(1).view(torch.uint8)
        write_rows_fast(_row_view(pages, fmt.row_bytes), slots, row)
        return
    keep = slots >= 0
    slots, k = slots[keep].long(), k[keep].float()
    if slots.numel() == 0:
        return
    bs = fmt.block_size_of(pages)
    rows = _row_view(pages, fmt.row_bytes)
    if fmt.method == "fp8":
        rows[slots // bs, slots % bs] = (
            k.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(1).view(torch.uint8)
        )
        return
    if fmt.method == "lowrank":
        if dims is None:
            raise ValueError("lowrank index keys need the kept dims")
        picked = torch.gather(k, 2, dims[None].expand(k.shape[0], -1, -1).to(k.device))
        rows[slots // bs, slots % bs] = picked.to(torch.float16).flatten(1).view(torch.uint8)
        return
    c = fmt.quest_chunk
    per_block = bs // c
    bounds = _quest_view(pages, fmt)  # [blocks, chunks per block, 2, G·D]
    chunk = slots // c  # blocks hold bs // c whole chunks, so this is the global chunk index
    touched, local = torch.unique(chunk, return_inverse=True)
    cur = bounds[touched // per_block, touched % per_block].clone()  # [U, 2, G·D]
    lo, hi = cur[:, 0], cur[:, 1]
    fresh = local[slots % c == 0]
    lo[fresh] = float("inf")
    hi[fresh] = float("-inf")
    flat = k.flatten(1)
    index = local[:, None].expand_as(flat)
    lo.scatter_reduce_(0, index, flat, "amin", include_self=True)
    hi.scatter_reduce_(0, index, flat, "amax", include_self=True)
    bounds[touched // per_block, touched % per_block] = cur


def _row_view(pages: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``[blocks, block_size, row_bytes]`` view of pages whose blocks may be strided (the
    engine's pages are layers of a shared GPU pool: one block's page, then other groups)."""
    return pages.unflatten(1, (pages.shape[1] // row_bytes, row_bytes))


def _quest_view(pages: torch.Tensor, fmt: GqaIndexerFormat) -> torch.Tensor:
    """``[blocks, chunks per block, 2, G·D]`` fp32 bounds of every chunk of the pages."""
    bs = fmt.block_size_of(pages)
    width = 8 * fmt.num_kv_heads * fmt.head_dim
    chunks = _row_view(pages, width).view(torch.float32)
    return chunks.view(pages.shape[0], bs // fmt.quest_chunk, 2, -1)


def read_index_keys(
    pages: torch.Tensor, fmt: GqaIndexerFormat, table: torch.Tensor, length: int
) -> torch.Tensor:
    """A request's compact keys, in position order, as fp32.

    ``table`` is the request's block-table row. fp8 / lowrank: ``[length, G, key_dim]``;
    quest: ``[num_chunks, 2, G, D]`` (min, max) of chunks ``0 .. ceil(length / chunk) - 1``.
    """
    bs = fmt.block_size_of(pages)
    g = fmt.num_kv_heads
    if fmt.method == "quest":
        c = fmt.quest_chunk
        start = torch.arange(0, length, c, device=pages.device)
        blocks = table[start // bs].long()
        bounds = _quest_view(pages, fmt)[blocks, (start % bs) // c]
        return bounds.reshape(-1, 2, g, fmt.head_dim)
    # Whole pages, then the first ``length`` rows: one contiguous copy per block.
    blocks = table[: -(-length // bs)].long()
    raw = pages.index_select(0, blocks).view(-1, fmt.row_bytes)[:length]
    if fmt.method == "fp8":
        return _fp8_to_float(raw).view(length, g, fmt.key_dim)
    return raw.view(torch.float16).float().view(length, g, fmt.key_dim)


def _fp8_to_float(raw: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> fp32, exactly ``raw.view(e4m3).float()``, through a 256-entry table
    (faster on the CPU than the cast, which dominated the decode indexer)."""
    lut = fp8_values(raw.device)
    return lut.index_select(0, raw.reshape(-1).int()).view(raw.shape)
