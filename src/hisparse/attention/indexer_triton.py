"""Triton lightning indexer over the paged key cache; `indexer_topk_paged_reference` is the oracle.

Two stages:

1. ``_indexer_scores_kernel`` writes ``scores [T, S]`` fp32, ``S`` = the block table's width
   (or the caller's ``max_len``): program ``(token, chunk)`` keeps the token's ``[H, D]``
   query in shared memory and walks its chunk of key positions in tiles of ``BLOCK_N``, each
   tile one ``[BLOCK_N, D] x [D, H]`` dot, ReLU, and the weighted sum over heads (keys are
   the MMA's rows, so that sum stays within a warp). Splitting the context into chunks
   gives a decode step (few tokens, up to 128K keys) thousands of programs; a prefill chunk
   works the same way, one row of programs per token. Positions past the token's causal
   limit (``positions[t] + 1``), and every position of a padding token (``req_index < 0``),
   get ``-inf``. When ``BLOCK_N`` divides the block size each tile is one contiguous run of
   one page: one block-table read per tile (not per key), which with 5 pipeline stages keeps
   two key tiles in flight per program (the table read is a load level of its own). The
   per-tile instructions (conversions, operand loads, masks, addresses) and the few
   programs an SM holds are the limit, so: tiles wholly before the causal limit run without
   masks; the page arithmetic is in compile-time shifts; the fp8 keys' dims (and the
   query's, alike) are reordered so that each thread's f16 MMA operand bytes sit together
   and come from shared memory in 16-byte loads, not two bytes at a time; and the chunks
   per row are sized so that the grid fills whole waves (`chunk_for`). On Hopper, where it
   applies, `indexer_gluon`'s kernel takes this stage instead: the same tiles and
   instructions, the keys copied through a TMA ring, the same scores bit for bit.
2. the exact top-k of each row: on CUDA the Triton radix select (`topk_triton`: five
   launches over a (row, part) grid, seven with the floor that decode batches of long rows
   take, six where the Gluon score kernel writes the floor's group maxima beside the scores
   (`select_maxima`), each row read only up to its token's causal limit; ties
   at the k-th score to the lowest positions, picks in ascending positions), elsewhere or with
   ``HISPARSE_TOPK=reference`` ``torch.topk`` (the reference's selection code; picks best
   first). Both run on the same scores and give the same set wherever the k-th score is not
   tied.

A top-k call runs both stages per block of query tokens whose scores stay under
`indexer_reference.SCORE_BLOCK_BYTES` (a 64K-token prefill chunk at 128K keys would otherwise
hold 32 GiB of scores); more than 65535 key chunks (grid axis 1) get longer chunks.

Why a select of our own: ``torch.topk`` over a 128K row took about as long as the score stage
at decode batches, whatever the batch (docs/benchmarks.md §15), mostly radix-sort kernels that
leave the GPU idle at small batches. The select needs no host synchronisation
and no data-dependent shape either, so a decode step still captures it in its CUDA graph.

Numerics, per mode (the reference's operation order is kept where it costs nothing):

- ``fp8`` pages (132-byte rows: ``block_size x 128`` e4m3 keys, then ``block_size`` fp32
  scales): e4m3 queries and keys go to the tensor cores as f16 (exact; bf16, the first
  kernel's choice, is exact too but costs three conversions per two values where f16 costs
  one) and accumulate in fp32, so each ``q . k`` product is exact and only the summation
  order differs from the reference (the reordered dims change only that order);
  ``w * q_scale * softmax_scale`` is folded per head and the key scale multiplies the head
  sum, as in the reference.
- ``fp32`` pages (exact mode): fp32 dots (``ieee``, no tf32), ``ReLU(q . k * scale)``.

Under Triton's CPU interpreter (CI) every dot runs in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hisparse.attention import indexer_gluon, triton_split
from hisparse.attention import indexer_reference as _ref
from hisparse.attention.dispatch import env_backend
from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.attention.topk_floor import GroupMaxima, group_maxima
from hisparse.attention.topk_triton import topk_select_triton
from hisparse.attention.triton_split import num_sms
from hisparse.kv.row_formats import IndexerCacheFormat

Tensor = torch.Tensor

#: Most indexer heads one program holds (DeepSeek-V3.2: 64, GLM-5: 32).
MAX_HEADS = 128


@dataclass(frozen=True)
class IndexerConfig:
    """Tile shape and operand type of the score kernel (`default_config` picks one per format).

    The defaults are the fp8 tuning of issue #5 (bench_indexer.py measures it against
    `OLD_FP8_CONFIG`, the first version's, which stays selectable for that comparison).
    """

    block_n: int = 64
    num_warps: int = 4
    #: Software-pipelining depth of the key loads. The block-table read is one more load
    #: level, so 3 stages keep one key tile in flight per program and 5 keep two.
    num_stages: int = 5
    #: MMA operand type of fp8 pages on a GPU: ``f16`` (e4m3 -> f16 is one conversion per two
    #: values and exact), ``bf16`` (also exact, but e4m3 -> bf16 goes through f16: three
    #: conversions per two values), or ``fp8`` (no conversion, half the MMA work; Hopper's
    #: fp8 MMA accumulates with fewer bits: its error measured outside the GPU tests'
    #: tolerance; with ``fp8_acc_k=32`` inside it, but no faster than f16). Opt-in variants
    #: bench_indexer.py measures. fp32 pages and the CPU interpreter always use fp32 dots.
    dot: str = "f16"
    #: One block-table read per tile, and a contiguous key run, when ``block_n`` divides the
    #: block size (else, and when off, every key looks up its own block as at first).
    page_tiles: bool = True
    #: ``dot="fp8"`` only: fp32 accumulation every this many products (``None``: Triton's
    #: default, all of K in the fp8 MMA accumulator).
    fp8_acc_k: int | None = None
    #: Page tiles of fp8 keys: reorder the 128 dims (keys and query alike; a dot does not
    #: depend on the order of its terms) so that the bytes each thread feeds the f16 MMA lie
    #: together, read from shared memory in a few wide loads instead of one load per pair.
    permute_k: bool = True
    #: Register cap per thread (Triton's ``maxnreg``; ``None``: the compiler's choice), and the
    #: programs per SM that `chunk_for` sizes the grid's waves for (4 at the default tile:
    #: registers and shared memory both allow 4, ncu).
    maxnreg: int | None = None
    programs_per_sm: int = 4

    def __post_init__(self) -> None:
        if self.dot not in ("f16", "bf16", "fp8"):
            raise ValueError(f"IndexerConfig.dot {self.dot!r}: expected 'f16', 'bf16' or 'fp8'")


#: The first kernel's fp8 configuration (per-key block lookups, bf16 MMA, 3 stages).
OLD_FP8_CONFIG = IndexerConfig(block_n=64, num_warps=4, num_stages=3, dot="bf16", page_tiles=False)


def default_config(kind: str) -> IndexerConfig:
    """fp8 keys: the tuned tile. fp32 keys (exact mode, not a serving path) are 4x wider in
    registers: 32-key tiles, and the first kernel's shape otherwise."""
    if kind == "fp8":
        return IndexerConfig()
    return IndexerConfig(block_n=32, num_stages=3, page_tiles=False)


def supports(q: Tensor, q_scale: Tensor | None, pages: Tensor, fmt: IndexerCacheFormat) -> bool:
    """Whether the kernel handles these inputs (else callers use the reference)."""
    d = fmt.head_dim
    shape_ok = (
        q.dim() == 3
        and q.shape[2] == d
        and q.shape[1] <= MAX_HEADS
        and d >= 16
        and d & (d - 1) == 0
        and pages.dtype == torch.uint8
        and pages.dim() == 2
        and pages.stride(1) == 1
        and pages.shape[1] % fmt.row_bytes == 0
        and pages.stride(0) % 4 == 0
        and pages.storage_offset() % 4 == 0
    )
    if not shape_ok:
        return False
    if fmt.kind == "fp8":
        return (
            fmt.scales_per_row == 1
            and q.dtype == torch.float8_e4m3fn
            and q_scale is not None
            and q_scale.shape[:2] == q.shape[:2]
            and q_scale.shape[-1] == 1
        )
    return q.dtype in (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _k_order(x, D: tl.constexpr):
    """``x [R, D]`` with its columns reordered so that the dims one thread feeds the f16 MMA
    (pairs ``2j, 2j+1`` and ``+8`` of every 16) are ``D / 4`` contiguous bytes per row."""
    r: tl.constexpr = x.shape[0]
    return tl.reshape(tl.permute(tl.reshape(x, [r, 4, D // 16, 2, 2]), [0, 2, 3, 1, 4]), [r, D])


@triton.jit
def _page_tile(
    q_t, w, key_ptr, ksc_ptr, table_row, row, n0, end, stop, block_size: tl.constexpr,
    sc_off: tl.constexpr, s_key_b, s_ksc_b, softmax_scale, IS_FP8: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8_ACC_K: tl.constexpr,
    MASKED: tl.constexpr, PERMUTE_K: tl.constexpr,
):  # fmt: skip
    """Scores of keys ``n0 .. n0 + BLOCK_N``, one page's contiguous run: one
    ``[BLOCK_N, D] x [D, H]`` dot, ReLU, the weighted head sum; masked only at the limit."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    pos = n0 + n
    blk = tl.load(table_row + n0 // block_size).to(tl.int64)
    off = n0 % block_size + n
    key_rows = key_ptr + blk * s_key_b + off[:, None] * D + d[None, :]
    scales = ksc_ptr + blk * s_ksc_b + sc_off + off
    if MASKED:
        valid = pos < end
        keys = tl.load(key_rows, mask=valid[:, None], other=0.0)
    else:
        keys = tl.load(key_rows)
    if PERMUTE_K:
        keys = _k_order(keys, D)
    logits = tl.dot(
        keys.to(q_t.dtype), q_t, input_precision=PRECISION, max_num_imprecise_acc=FP8_ACC_K
    )  # [BLOCK_N, HP]
    if not IS_FP8:
        logits = logits * softmax_scale
    logits = tl.maximum(logits, 0.0)
    score = tl.sum(logits * w[None, :], axis=1)
    if MASKED:
        if IS_FP8:
            score *= tl.load(scales, mask=valid, other=0.0)
        tl.store(row + pos, tl.where(valid, score, float("-inf")), mask=pos < stop)
    else:
        if IS_FP8:
            score *= tl.load(scales)
        tl.store(row + pos, score)


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    qs_ptr,  # fp32 q scales [T, H] (fp8 only)
    w_ptr,
    key_ptr,  # pages viewed as e4m3 (fp8) or fp32
    ksc_ptr,  # pages viewed as fp32 (fp8 key scales)
    table_ptr,
    req_ptr,
    pos_ptr,
    out_ptr,
    softmax_scale,
    num_heads,
    num_cols,
    block_size: tl.constexpr,  # (constexpr: the page arithmetic per tile becomes shifts)
    chunk,
    sc_off: tl.constexpr,  # fp32 element of a page's first key scale
    s_q_t,
    s_q_h,
    s_qs_t,
    s_qs_h,
    s_w_t,
    s_w_h,
    s_key_b,
    s_ksc_b,
    s_tab_r,
    s_out_t,
    IS_FP8: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    FP8_ACC_K: tl.constexpr,
    PERMUTE_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * chunk
    req = tl.load(req_ptr + t)
    limit = tl.where(req >= 0, tl.load(pos_ptr + t) + 1, 0).to(tl.int32)
    stop = tl.minimum(start + chunk, num_cols)
    end = tl.maximum(tl.minimum(stop, limit), start)
    row = out_ptr + t * s_out_t
    n = tl.arange(0, BLOCK_N)

    heads = tl.arange(0, HP)
    hmask = heads < num_heads
    h64 = heads.to(tl.int64)  # any q / weight strides (head-major ones too)
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + t * s_q_t + h64[:, None] * s_q_h + d[None, :], mask=hmask[:, None], other=0.0
    ).to(DOT)
    w = tl.load(w_ptr + t * s_w_t + h64 * s_w_h, mask=hmask, other=0.0)
    if IS_FP8:
        w = w * tl.load(qs_ptr + t * s_qs_t + h64 * s_qs_h, mask=hmask, other=0.0)
        w = w * softmax_scale
    if PERMUTE_K:
        q = _k_order(q, D)
    q_t = tl.trans(q)  # [D, HP]
    table_row = table_ptr + tl.maximum(req, 0).to(tl.int64) * s_tab_r

    if PAGE_TILES:
        # Every tile lies inside one page (BLOCK_N divides the block size and chunks start on
        # a tile): one block-table entry per tile, and the tile's keys are one contiguous run.
        # Tiles wholly before the causal limit need no masks (fewer instructions per tile);
        # only the one ragged tile at the limit takes the masked body.
        full = start + (end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, full, BLOCK_N):
            _page_tile(
                q_t, w, key_ptr, ksc_ptr, table_row, row, n0, end, stop, block_size, sc_off,
                s_key_b, s_ksc_b, softmax_scale, IS_FP8, D, BLOCK_N, PRECISION, FP8_ACC_K, False,
                PERMUTE_K,
            )  # fmt: skip
        if full < end:
            _page_tile(
                q_t, w, key_ptr, ksc_ptr, table_row, row, full, end, stop, block_size, sc_off,
                s_key_b, s_ksc_b, softmax_scale, IS_FP8, D, BLOCK_N, PRECISION, FP8_ACC_K, True,
                PERMUTE_K,
            )  # fmt: skip
    else:
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n
            valid = pos < end
            blk = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
            off = pos % block_size
            keys = tl.load(
                key_ptr + blk[:, None] * s_key_b + off[:, None] * D + d[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(DOT)
            # Keys as the MMA's M dim: the head sum then reduces along N, inside each warp.
            logits = tl.dot(keys, q_t, input_precision=PRECISION)  # [BLOCK_N, HP]
            if not IS_FP8:  # exact mode: ReLU(q . k * scale); fp8 folds the scale into w
                logits = logits * softmax_scale
            logits = tl.maximum(logits, 0.0)
            score = tl.sum(logits * w[None, :], axis=1)
            if IS_FP8:
                score *= tl.load(ksc_ptr + blk * s_ksc_b + sc_off + off, mask=valid, other=0.0)
            tl.store(row + pos, tl.where(valid, score, float("-inf")), mask=pos < stop)

    # Tiles wholly past the causal limit: -inf without reading anything.
    tail = start + tl.cdiv(end - start, BLOCK_N) * BLOCK_N
    for n0 in range(tail, stop, BLOCK_N):
        pos = n0 + n
        tl.store(row + pos, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=pos < stop)


#: Fewest and most key tiles per program.
MIN_TILES, MAX_TILES = 2, 64
#: A program's fixed cost (its query and weights, the pipeline's fill) in key tiles: what
#: stops the chunk choice from cutting rows ever finer.
PROGRAM_TILES = 4


def chunk_for(
    num_tokens: int, num_cols: int, block_n: int, device: torch.device, programs_per_sm: int = 4
) -> int:
    """Keys per program (shapes only): the tile count with the least modelled time, waves x
    (tiles + `PROGRAM_TILES`), a wave being ``programs_per_sm`` programs on every SM, so that
    no wave runs mostly empty (29 rows of 128K in 64-tile chunks made 957 programs: 1.8 waves
    of 528, the second 0.8 full). Ties go to the shorter chunk: more waves, which balance
    rows of different lengths better."""
    tiles = triton.cdiv(max(num_cols, 1), block_n)
    slots = programs_per_sm * num_sms(device)
    return block_n * _tiles_per_chunk(max(num_tokens, 1), tiles, slots)


@functools.lru_cache(maxsize=256)
def _tiles_per_chunk(rows: int, tiles: int, slots: int) -> int:
    best, best_cost = MAX_TILES, None
    for n in range(MIN_TILES, MAX_TILES + 1):
        cost = triton.cdiv(rows * triton.cdiv(tiles, n), slots) * (n + PROGRAM_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = n, cost
    return best


#: The compiled score kernel of the last launch (benchmarks read registers and spills).
last_compiled: list = [None]


def indexer_scores_paged_triton(
    q: Tensor,
    q_scale: Tensor | None,
    weights: Tensor,
    pages: Tensor,
    fmt: IndexerCacheFormat,
    block_table: Tensor,
    req_index: Tensor,
    positions: Tensor,
    softmax_scale: float,
    *,
    max_len: int | None = None,
    config: IndexerConfig | None = None,
    chunk: int | None = None,
    maxima: GroupMaxima | None = None,
) -> Tensor:
    """``fp32 [T, S]`` scores of each token against its request's keys, ``-inf`` past its limit.

    ``S`` is ``block_table.shape[1] * block_size``, or ``max_len`` when given (it must be at
    least every ``positions[t] + 1``). Arguments as in `indexer_topk_paged_reference`;
    ``config`` / ``chunk`` override the tile shape and keys per program. ``maxima``: the
    top-k's group maxima, which the Gluon kernel writes with the scores (then ``filled``).
    """
    if not supports(q, q_scale, pages, fmt):
        raise ValueError(
            f"Triton indexer needs a power-of-two head_dim >= 16, at most {MAX_HEADS} heads, "
            f"one fp8 scale per key (or fp32 keys) and uint8 pages with unit byte stride; got "
            f"{fmt}, q {q.dtype} {tuple(q.shape)}, pages {tuple(pages.shape)} strides "
            f"{pages.stride()}"
        )
    t, h, d = q.shape
    if weights.shape != (t, h) or req_index.shape != (t,) or positions.shape != (t,):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, weights {tuple(weights.shape)}, req_index "
            f"{tuple(req_index.shape)}, positions {tuple(positions.shape)}"
        )
    bs = pages.shape[1] // fmt.row_bytes
    cols = score_cols(pages, fmt, block_table, max_len)
    device = q.device
    out = torch.empty(t, cols, dtype=torch.float32, device=device)
    if t == 0 or cols == 0:
        return out
    cfg = config or default_config(fmt.kind)
    page_tiles = cfg.page_tiles and bs % cfg.block_n == 0
    gluon = (
        config is None
        and not interpreting()
        and indexer_gluon.usable(q, q_scale, pages, fmt, page_tiles)
        and (t * cols >= indexer_gluon.EAGER_MIN_KEYS or torch.cuda.is_current_stream_capturing())
    )
    if gluon and chunk is None:
        chunk = chunk_for(t, cols, cfg.block_n, device, indexer_gluon.PROGRAMS_PER_SM)
        gluon = chunk >= indexer_gluon.MIN_TILES * cfg.block_n
        chunk = chunk if gluon else None
    chunk = chunk or chunk_for(t, cols, cfg.block_n, device, cfg.programs_per_sm)
    if chunk % cfg.block_n:
        raise ValueError(f"chunk {chunk} is not a multiple of block_n {cfg.block_n}")
    while triton.cdiv(cols, chunk) > triton_split.MAX_GRID_YZ:  # chunks are grid axis 1
        chunk *= 2  # (still a multiple of block_n; a key's score does not depend on it)

    is_fp8 = fmt.kind == "fp8"
    ksc_view = pages.view(torch.float32)
    key_view = pages.view(torch.float8_e4m3fn) if is_fp8 else ksc_view
    if is_fp8:
        assert q_scale is not None
        qs = q_scale[..., 0]
        qs = qs if qs.dtype == torch.float32 else qs.float()
    else:
        qs = weights  # unused
    weights = weights if weights.dtype == torch.float32 else weights.float()
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if gluon:
        last_compiled[0] = indexer_gluon.launch(
            q, qs, weights, pages, fmt, block_table, req_index, positions, out, softmax_scale,
            chunk, maxima if maxima and chunk % maxima.group == 0 else None,
        )  # fmt: skip
        return out

    interp = interpreting() or device.type != "cuda"
    if not is_fp8 or interp:
        dot = tl.float32
    else:  # e4m3 -> f16 and e4m3 -> bf16 are exact
        dot = {"f16": tl.float16, "bf16": tl.bfloat16, "fp8": tl.float8e4nv}[cfg.dot]
    fp8_acc_k = cfg.fp8_acc_k if dot == tl.float8e4nv else None
    grid = (t, triton.cdiv(cols, chunk))
    extra = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
    last_compiled[0] = _indexer_scores_kernel[grid](
        q, qs, weights, key_view, ksc_view, block_table, req_index, positions, out,
        softmax_scale, h, cols, bs, chunk, bs * d // 4,
        q.stride(0), q.stride(1), qs.stride(0), qs.stride(1), weights.stride(0),
        weights.stride(1), key_view.stride(0), ksc_view.stride(0), block_table.stride(0),
        out.stride(0),
        IS_FP8=is_fp8, D=d, HP=max(16, triton.next_power_of_2(h)), BLOCK_N=cfg.block_n,
        DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32",  # only fp32 operands read it
        PAGE_TILES=page_tiles,
        FP8_ACC_K=fp8_acc_k,
        PERMUTE_K=cfg.permute_k and page_tiles and is_fp8 and d % 16 == 0 and dot != tl.float8e4nv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip
    return out


def score_cols(
    pages: Tensor, fmt: IndexerCacheFormat, block_table: Tensor, max_len: int | None
) -> int:
    """Score columns ``S`` of a call: the block table's positions, at most ``max_len``."""
    cols = block_table.shape[1] * (pages.shape[1] // fmt.row_bytes)
    return cols if max_len is None else min(cols, max_len)


#: Rows up to which the Triton select runs instead of ``torch.topk`` (docs/benchmarks.md §15:
#: faster up to 64 rows of 128K, slower at a 2048-row prefill block, where each SM's share of
#: the first histogram's per-key work bounds it).
SELECT_MAX_ROWS = 64


def topk_from_scores(
    scores: Tensor,
    top_k: int,
    out: Tensor | None = None,
    *,
    positions: Tensor | None = None,
    req_index: Tensor | None = None,
    maxima: GroupMaxima | None = None,
) -> Tensor:
    """``int32 [T, top_k]`` best positions of each row, ``-inf`` picks and padding ``-1``;
    written into ``out`` (every element) when given. On CUDA, up to `SELECT_MAX_ROWS` rows,
    the Triton radix select (`topk_triton`; ``HISPARSE_TOPK=reference`` keeps ``torch.topk``),
    which reads each row only up to the token's causal limit when ``positions`` (and
    ``req_index``) are given. ``maxima``: from `select_maxima` for this call."""
    if _triton_select(scores.shape[0], scores.device):
        return topk_select_triton(
            scores, top_k, out, positions=positions, req_index=req_index, maxima=maxima
        )
    t, s = scores.shape
    kk = min(top_k, s)
    if out is None:
        out = torch.empty((t, top_k), dtype=torch.int32, device=scores.device)
    out[:, kk:] = -1
    if kk == 0 or t == 0:
        return out
    vals, idx = scores.topk(kk, dim=-1)
    out[:, :kk] = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
    return out


def _triton_select(t: int, device: torch.device) -> bool:
    return env_backend("HISPARSE_TOPK", device) == "triton" and (
        t <= SELECT_MAX_ROWS or device.type != "cuda"
    )


def select_maxima(t: int, cols: int, top_k: int, device: torch.device) -> GroupMaxima | None:
    """The group maxima that `topk_from_scores` will read for ``[t, cols]`` scores on CUDA,
    for the score kernel to write (None where its select takes no floor). The select must
    follow the score kernel that fills them: they add to its histograms."""
    if device.type != "cuda" or not _triton_select(t, device):
        return None
    return group_maxima(t, cols, top_k, device)


def indexer_topk_paged_triton(
    q: Tensor,
    q_scale: Tensor | None,
    weights: Tensor,
    pages: Tensor,
    fmt: IndexerCacheFormat,
    block_table: Tensor,
    req_index: Tensor,
    positions: Tensor,
    top_k: int,
    softmax_scale: float,
    *,
    max_len: int | None = None,
    config: IndexerConfig | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Contract of `indexer_topk_paged_reference` (``seq_lens`` is not needed: the causal
    limit ``positions + 1`` bounds every token's keys).

    The tokens are scored in row blocks of at most `indexer_reference.SCORE_BLOCK_BYTES` of
    scores (`score_row_blocks`; shapes only, so still capturable), each block's top-k written
    into one output: the picks of one un-blocked call, since every block runs with the key
    chunk of the whole call and a row's scores and top-k depend on that row alone (up to
    ``torch.topk``'s order among exactly equal scores, which no call specifies).
    """
    t = q.shape[0]
    cols = score_cols(pages, fmt, block_table, max_len)
    blocks = _ref.score_row_blocks(t, 4 * cols)
    if len(blocks) <= 1:
        maxima = select_maxima(t, cols, top_k, q.device)
        scores = indexer_scores_paged_triton(
            q, q_scale, weights, pages, fmt, block_table, req_index, positions, softmax_scale,
            max_len=max_len, config=config, chunk=chunk, maxima=maxima,
        )  # fmt: skip
        return topk_from_scores(
            scores, top_k, positions=positions, req_index=req_index, maxima=maxima
        )
    cfg = config or default_config(fmt.kind)
    chunk = chunk or chunk_for(t, cols, cfg.block_n, q.device, cfg.programs_per_sm)
    out = torch.empty((t, top_k), dtype=torch.int32, device=q.device)
    for lo, hi in blocks:  # one block's scores alive at a time
        topk_from_scores(
            indexer_scores_paged_triton(
                q[lo:hi], None if q_scale is None else q_scale[lo:hi], weights[lo:hi], pages,
                fmt, block_table, req_index[lo:hi], positions[lo:hi], softmax_scale,
                max_len=max_len, config=config, chunk=chunk,
            ),
            top_k,
            out=out[lo:hi],
            positions=positions[lo:hi],
            req_index=req_index[lo:hi],
        )  # fmt: skip
    return out


def indexer_bytes(contexts: list[int], fmt: IndexerCacheFormat) -> int:
    """Fewest HBM bytes the score stage reads for decode tokens of these context lengths."""
    return sum(contexts) * fmt.row_bytes


# -- checking against the reference (tests, GPU tests, benchmark) ------------------------------


__all__ = [
    "OLD_FP8_CONFIG",
    "IndexerConfig",
    "chunk_for",
    "default_config",
    "indexer_bytes",
    "indexer_scores_paged_triton",
    "indexer_topk_paged_triton",
    "score_cols",
    "supports",
    "topk_from_scores",
]
