"""Triton GQA decode indexer (``fp8`` method); `gqa_indexer_topk_decode_reference` is the oracle.

The torch path of a batch-64 decode step costs many small kernels per layer (a page gather, an
e4m3 table lookup, an sgemm, the softmax reductions, ``topk``, an index sort). Here it is two
launches per layer, with the selection rule of `select_topk` unchanged:

1. ``_gqa_logits_kernel``, program ``(request, chunk of CHUNK key positions)``: for each KV head
   ``g`` the ``[BLOCK_N, D]`` e4m3 key tile (read through the block table) times the group's
   queries ``[D, 16]`` (the ``H/G`` heads padded to a tensor-core tile), ``* scale``; the logits
   of the candidate positions go to an fp32 scratch ``[R, H, longest]`` and the chunk's online
   softmax statistics (max, sum of exp per head) to ``[R, chunks, 2, H]``. Only candidate
   positions are read: they are one contiguous range ``[sinks, recent window start)``.
2. ``_gqa_select_kernel``, one program per request: merges the chunk statistics into each
   head's log-sum-exp, writes each candidate's mass ``Σ_h exp(logit - lse_h)`` (fp32) to a
   scratch row, finds the exact k-th largest mass by a 31-step binary search over the
   order-preserving int32 bits of the (non-negative) masses (in registers when the candidates
   fit in one ``BLOCK_S`` tile, else tile by tile), and writes the row in ascending order:
   sinks, kept candidates (in-register prefix sums give the columns), recent window, ``-1``.

Tie rule (deterministic; the torch path's ``topk`` tie order is unspecified): every candidate
whose mass is above the k-th value is kept, then those equal to it in ascending position order
until exactly ``min(top_k, longest)`` positions are kept in total.

Numerics: e4m3 keys are exact in bf16; on the GPU a bf16 ``q`` goes to the tensor cores as is
(products exact, fp32 accumulation), an fp16 / fp32 ``q`` as the sum of 2 / 3 bf16 parts (the
split is exact, so only the fp32 summation order differs from the reference's sgemm). Under
Triton's CPU interpreter the dots are fp32. Softmax statistics and masses are fp32, as in
`select_topk`.

Scope: the ``fp8`` method only (`supports`); quest and lowrank stay on the torch path, as does
everything on a CPU without the interpreter. Each request scans ``min(lengths[r],
positions[r] + 1)`` keys (the reference's causal mask with ``positions[r] = lengths[r] - 1``,
what a decode step passes), so ``longest`` may be the block table's capacity (CUDA graphs):
it sizes the scratch buffers only. Any context length works; contexts whose candidates exceed
``BLOCK_S`` (4096 by default) take the tile-by-tile binary search (slower, same result). No
host read, no allocation that depends on device values: CUDA-graph capturable. Scratch past
`SCRATCH_BLOCK_BYTES` splits the batch into blocks of requests run one after the other, and
more than 65535 chunks (grid axis 1) get longer chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hisparse.attention import triton_split
from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat
from hisparse.attention.gqa_indexer_select import dense_rows
from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.attention.triton_split import num_sms

Tensor = torch.Tensor

#: Rows of a tensor-core dot: a KV head's query group is padded up to this.
_MIN_GROUP = 16
#: Most query heads per KV head one program holds.
MAX_GROUP = 64
#: Most bytes of fp32 scratch (logits ``[R, H, longest]``, masses ``[R, longest]``, chunk
#: statistics) one launch pair holds: a large batch at a long context, or at a long
#: capacity bound under CUDA graphs, runs in blocks of requests. Tests lower it.
SCRATCH_BLOCK_BYTES = 1 << 30


@dataclass(frozen=True)
class GqaIndexerTritonConfig:
    """Tile shapes (``None``: picked from the shapes by `default_config`)."""

    block_n: int = 64  # keys per dot tile
    chunk: int | None = None  # keys per program of the logits kernel
    block_m: int = 128  # positions per tile of the mass pass
    block_s: int | None = None  # positions of the in-register selection tile
    block_w: int = 256  # output columns per store tile
    warps_logits: int = 4
    warps_select: int = 8


def default_config(num_requests: int, longest: int, device: torch.device) -> GqaIndexerTritonConfig:
    """Chunks that give a few programs per SM for long contexts at small batches (shapes only:
    under CUDA graphs ``longest`` is the table's capacity, not the real length). At most 128
    keys: the best of 64..512 in bench_gqa_indexer's H200 sweep at batch 64 / 556 keys, close
    to 256 at 8192 keys (docs/benchmarks.md §11)."""
    want = triton.cdiv(num_requests * 2048, 2 * num_sms(device))
    chunk = max(64, min(128, triton.next_power_of_2(want)))
    block_s = max(16, min(4096, triton.next_power_of_2(longest)))
    return GqaIndexerTritonConfig(chunk=chunk, block_s=block_s)


def supports(
    q: Tensor, pages: Tensor, tables: Tensor, fmt: GqaIndexerFormat, cfg: GqaIndexerConfig
) -> bool:
    """Whether the kernels handle these inputs (else the torch path runs)."""
    d = fmt.head_dim
    g = fmt.num_kv_heads
    on_device = q.device.type == "cuda" or interpreting()
    return (
        on_device
        and fmt.method == "fp8"
        and cfg.method == "fp8"
        and q.dim() == 3
        and q.shape[2] == d
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.shape[1] % g == 0
        and q.shape[1] // g <= MAX_GROUP
        and d >= 16
        and d & (d - 1) == 0
        and pages.dim() == 2
        and pages.dtype == torch.uint8
        and pages.stride(1) == 1
        and pages.shape[1] % (g * d) == 0
        and tables.dim() == 2
        and not tables.is_floating_point()
    )


@triton.jit
def _regions(length, pos, sink, window):
    """``(n, ns, rs)``: keys scanned ``[0, n)``, sinks ``[0, ns)``, candidates ``[ns, rs)``,
    recent window ``[rs, n)``."""
    n = tl.maximum(tl.minimum(length, pos + 1), 0)
    ns = tl.minimum(sink, n)
    rs = tl.minimum(tl.maximum(pos - window + 1, ns), n)
    return n, ns, rs


@triton.jit
def _gqa_logits_kernel(
    q_ptr,
    key_ptr,  # the pages viewed as e4m3: [blocks, block_size * G * D]
    table_ptr,
    pos_ptr,
    len_ptr,
    lg_ptr,  # fp32 [R, H, >= longest] candidate logits
    st_ptr,  # fp32 [R, chunks, 2, H]: per-chunk max and sum of exp
    scale,
    top_k,
    sink,
    window,
    block_size,
    num_heads,
    group,  # query heads per KV head
    s_q_r,
    s_q_h,
    s_key_b,
    s_tab_r,
    s_lg_r,
    s_lg_h,
    s_st_r,
    s_st_c,
    G: tl.constexpr,
    D: tl.constexpr,
    GP: tl.constexpr,  # group padded to a dot tile
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_PARTS: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    length = tl.load(len_ptr + r).to(tl.int32)
    pos = tl.load(pos_ptr + r).to(tl.int32)
    _, ns, rs = _regions(length, pos, sink, window)
    start = c * CHUNK
    if (length > top_k) & (start < rs):
        lo = tl.maximum(start, ns)
        hi = tl.minimum(start + CHUNK, rs)
        j = tl.arange(0, GP)
        jm = j < group
        d = tl.arange(0, D)
        nn = tl.arange(0, BLOCK_N)
        table_row = table_ptr + r.to(tl.int64) * s_tab_r
        st_row = st_ptr + r.to(tl.int64) * s_st_r + c * s_st_c
        lg_row = lg_ptr + r.to(tl.int64) * s_lg_r
        for g in tl.static_range(G):
            heads = g * group + j
            qf = tl.load(
                q_ptr + r.to(tl.int64) * s_q_r + heads.to(tl.int64)[:, None] * s_q_h + d[None, :],
                mask=jm[:, None],
                other=0.0,
            ).to(tl.float32)
            # An exact split of q into Q_PARTS values of the dot dtype (bf16 keeps 8 bits).
            q0 = qf.to(DOT)
            q0t = tl.trans(q0)
            rest = qf - q0.to(tl.float32)
            q1t = tl.trans(rest.to(DOT))
            rest = rest - rest.to(DOT).to(tl.float32)
            q2t = tl.trans(rest.to(DOT))
            m = tl.full([GP], float("-inf"), tl.float32)
            acc_l = tl.zeros([GP], tl.float32)
            for s0 in range(lo, hi, BLOCK_N):
                s = s0 + nn
                valid = s < hi
                blk = tl.load(table_row + s // block_size, mask=valid, other=0).to(tl.int64)
                keys = tl.load(
                    key_ptr
                    + blk[:, None] * s_key_b
                    + ((s % block_size) * (G * D) + g * D)[:, None]
                    + d[None, :],
                    mask=valid[:, None],
                    other=0.0,
                ).to(DOT)
                dots = tl.dot(keys, q0t, input_precision=PRECISION)  # [BLOCK_N, GP]
                if Q_PARTS > 1:
                    dots = tl.dot(keys, q1t, dots, input_precision=PRECISION)
                if Q_PARTS > 2:
                    dots = tl.dot(keys, q2t, dots, input_precision=PRECISION)
                lg = dots * scale
                lg = tl.where(valid[:, None] & jm[None, :], lg, float("-inf"))
                tl.store(
                    lg_row + heads[None, :] * s_lg_h + s[:, None],
                    lg,
                    mask=valid[:, None] & jm[None, :],
                )
                m_new = tl.maximum(m, tl.max(lg, axis=0))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                acc_l = acc_l * tl.exp(m - shift) + tl.sum(tl.exp(lg - shift[None, :]), axis=0)
                m = m_new
            tl.store(st_row + heads, m, mask=jm)
            tl.store(st_row + num_heads + heads, acc_l, mask=jm)


@triton.jit
def _count_from(row, lo, hi, threshold, STRICT: tl.constexpr, BLOCK_S: tl.constexpr):
    """How many scores of ``row[lo:hi]`` have int32 bits ``>= threshold`` (``>`` if STRICT)."""
    cnt = tl.sum(tl.zeros([BLOCK_S], tl.int32), axis=0)
    for s0 in range(lo, hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        bits = tl.load(row + s, mask=s < hi, other=-1.0).to(tl.int32, bitcast=True)
        hit = bits >= threshold
        if STRICT:
            hit = hit & (bits != threshold)
        cnt += tl.sum(hit.to(tl.int32), axis=0)
    return cnt


@triton.jit
def _gqa_select_kernel(
    lg_ptr,
    st_ptr,
    sc_ptr,  # fp32 [R, >= longest] scratch: candidate masses
    pos_ptr,
    len_ptr,
    out_ptr,  # int32 [R, width]
    top_k,
    kk,  # positions kept per scored request: min(top_k, longest)
    width,
    sink,
    window,
    num_heads,
    s_lg_r,
    s_lg_h,
    s_st_r,
    s_st_c,
    s_sc_r,
    s_out_r,
    CHUNK: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    length = tl.load(len_ptr + r).to(tl.int32)
    pos = tl.load(pos_ptr + r).to(tl.int32)
    out_row = out_ptr + r.to(tl.int64) * s_out_r
    cols = tl.arange(0, BLOCK_W)
    if length <= top_k:  # fits: every causal position (`dense_rows`: none without keys)
        for w0 in range(0, width, BLOCK_W):
            cc = w0 + cols
            tl.store(out_row + cc, tl.where((cc <= pos) & (cc < length), cc, -1), mask=cc < width)
    else:
        n, ns, rs = _regions(length, pos, sink, window)
        heads = tl.arange(0, HP)
        hm = heads < num_heads
        st_row = st_ptr + r.to(tl.int64) * s_st_r
        # Each head's log-sum-exp over its candidates, from the chunk statistics.
        nch = tl.cdiv(rs, CHUNK)
        top = tl.full([HP], float("-inf"), tl.float32)
        for c in range(nch):
            m = tl.load(st_row + c * s_st_c + heads, mask=hm, other=float("-inf"))
            top = tl.maximum(top, m)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([HP], tl.float32)
        for c in range(nch):
            m = tl.load(st_row + c * s_st_c + heads, mask=hm, other=float("-inf"))
            acc_l = tl.load(st_row + c * s_st_c + num_heads + heads, mask=hm, other=0.0)
            total += acc_l * tl.exp(m - top)
        lse = tl.where(hm & (total > 0), top + tl.log(tl.where(total > 0, total, 1.0)), 0.0)

        # Mass of each candidate over the heads -> scratch row.
        lg_row = lg_ptr + r.to(tl.int64) * s_lg_r
        sc_row = sc_ptr + r.to(tl.int64) * s_sc_r
        mm = tl.arange(0, BLOCK_M)
        for s0 in range(ns, rs, BLOCK_M):
            s = s0 + mm
            v = s < rs
            lg = tl.load(
                lg_row + heads[:, None] * s_lg_h + s[None, :],
                mask=hm[:, None] & v[None, :],
                other=float("-inf"),
            )
            mass = tl.sum(tl.exp(lg - lse[:, None]), axis=0)
            tl.store(sc_row + s, mass, mask=v)
        tl.debug_barrier()  # the scratch row is read back by other threads of this program

        # The k-th largest mass: the largest int32 threshold T with count(bits >= T) >= need.
        n_forced = ns + (n - rs)
        n_cand = rs - ns
        need = tl.maximum(kk - n_forced, 0)
        ss = tl.arange(0, BLOCK_S)
        thr = length * 0 - 1  # keep every candidate (bits of a mass are >= 0)
        tie_need = length * 0
        if n_cand > need:
            thr = length * 0
            if n_cand <= BLOCK_S:  # one tile: the search runs in registers
                s = ns + ss
                bits = tl.load(sc_row + s, mask=s < rs, other=-1.0).to(tl.int32, bitcast=True)
                for b in tl.static_range(31):
                    trial = thr | (1 << (30 - b))
                    cnt = tl.sum((bits >= trial).to(tl.int32), axis=0)
                    thr = tl.where(cnt >= need, trial, thr)
                above = tl.sum((bits > thr).to(tl.int32), axis=0)
            else:
                for b in tl.static_range(31):
                    trial = thr | (1 << (30 - b))
                    cnt = _count_from(sc_row, ns, rs, trial, False, BLOCK_S)
                    thr = tl.where(cnt >= need, trial, thr)
                above = _count_from(sc_row, ns, rs, thr, True, BLOCK_S)
            tie_need = need - above
        kept_c = tl.minimum(need, n_cand)

        # Kept candidates, ascending, in columns ns .. ns + kept_c - 1.
        done = length * 0
        ties = length * 0
        for s0 in range(ns, rs, BLOCK_S):
            s = s0 + ss
            v = s < rs
            bits = tl.load(sc_row + s, mask=v, other=-1.0).to(tl.int32, bitcast=True)
            tie = v & (bits == thr)
            rank = ties + tl.cumsum(tie.to(tl.int32), axis=0)
            keep = (v & (bits > thr)) | (tie & (rank <= tie_need))
            col = ns + done + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(out_row + col, s, mask=keep & (col < width))
            done += tl.sum(keep.to(tl.int32), axis=0)
            ties += tl.sum(tie.to(tl.int32), axis=0)
        # Sinks, the recent window after the candidates, then -1.
        for w0 in range(0, width, BLOCK_W):
            cc = w0 + cols
            recent = rs + (cc - ns - kept_c)
            val = tl.where(cc < ns, cc, tl.where(recent < n, recent, -1))
            tl.store(out_row + cc, val, mask=(cc < width) & ((cc < ns) | (cc >= ns + kept_c)))


def _scratch(
    r: int, h: int, longest: int, nch: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialised fp32 logits ``[R, H, longest]``, chunk statistics ``[R, chunks, 2, H]``
    and masses ``[R, longest]`` (only what the kernels write is read back)."""
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.empty((r, h, longest), **f32),
        torch.empty((r, nch, 2, h), **f32),
        torch.empty((r, longest), **f32),
    )


def gqa_indexer_topk_decode_triton(
    q: Tensor,
    positions: Tensor,
    pages: Tensor,
    tables: Tensor,
    lengths: Tensor,
    longest: int,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    *,
    config: GqaIndexerTritonConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """`gqa_indexer_topk_decode_reference` for the ``fp8`` method: ``int32 [R, width]`` ascending
    positions, ``-1`` padded (see the module docstring for the tie rule). ``out``: a caller's
    ``int32 [R, width]`` buffer, every element of which is written."""
    r, h, d = q.shape
    if cfg.top_k is None or longest <= cfg.top_k:
        return dense_rows(positions, lengths, width)
    if not supports(q, pages, tables, fmt, cfg):
        raise ValueError(
            f"Triton GQA indexer: needs the fp8 method, q [R, H, {fmt.head_dim}] (H a multiple "
            f"of {fmt.num_kv_heads}) on CUDA, uint8 pages with unit byte stride; got q "
            f"{tuple(q.shape)} {q.dtype} on {q.device}, pages {tuple(pages.shape)}"
        )
    device = q.device
    if out is None:
        out = torch.empty((r, width), dtype=torch.int32, device=device)
    if out.shape != (r, width) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out must be int32 [{r}, {width}] with unit column stride")
    if r == 0 or width == 0:
        return out
    g = fmt.num_kv_heads
    group = h // g
    bs = fmt.block_size_of(pages)
    tc = config or default_config(r, longest, device)
    auto = default_config(r, longest, device)
    chunk = tc.chunk or auto.chunk
    block_s = tc.block_s or auto.block_s
    assert chunk is not None and block_s is not None
    if chunk % tc.block_n:
        raise ValueError(f"chunk {chunk} is not a multiple of block_n {tc.block_n}")
    if h * longest >= 2**31:  # the kernels' offsets within one request's logits are int32
        raise ValueError(f"Triton GQA indexer: {h} heads x {longest} positions >= 2^31")
    while triton.cdiv(longest, chunk) > triton_split.MAX_GRID_YZ:  # chunks are grid axis 1
        chunk *= 2  # still a multiple of block_n
    nch = triton.cdiv(longest, chunk)
    # Requests per launch pair: the scratch of one block stays under SCRATCH_BLOCK_BYTES
    # (blocks of about equal size share one allocation; the chunking is the whole call's).
    per_req = 4 * (h + 1) * longest + 8 * nch * h
    step = max(1, SCRATCH_BLOCK_BYTES // per_req)
    step = triton.cdiv(r, triton.cdiv(r, step))

    q = q if q.stride(-1) == 1 else q.contiguous()
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    keys = pages.view(torch.float8_e4m3fn)
    logits, stats, scores = _scratch(step, h, longest, nch, device)

    interp = interpreting() or device.type != "cuda"
    if interp:  # the interpreter's bf16 dot is wrong: fp32 throughout
        dot, parts, precision = tl.float32, 1, "ieee"
    else:
        dot, precision = tl.bfloat16, "tf32"  # precision is read for fp32 operands only
        parts = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[q.dtype]
    top_k = int(cfg.top_k)
    for lo in range(0, r, step):
        hi = min(r, lo + step)
        pos, lens = positions[lo:hi], lengths[lo:hi]
        _gqa_logits_kernel[(hi - lo, nch)](
            q[lo:hi], keys, tables[lo:hi], pos, lens, logits, stats,
            float(scale), top_k, cfg.sink_tokens, cfg.recent_window, bs, h, group,
            q.stride(0), q.stride(1), keys.stride(0), tables.stride(0),
            logits.stride(0), logits.stride(1), stats.stride(0), stats.stride(1),
            G=g, D=d, GP=max(_MIN_GROUP, triton.next_power_of_2(group)), CHUNK=chunk,
            BLOCK_N=tc.block_n, Q_PARTS=parts, DOT=dot, PRECISION=precision,
            num_warps=tc.warps_logits,
        )  # fmt: skip
        _gqa_select_kernel[(hi - lo,)](
            logits, stats, scores, pos, lens, out[lo:hi],
            top_k, min(top_k, longest), width, cfg.sink_tokens, cfg.recent_window, h,
            logits.stride(0), logits.stride(1), stats.stride(0), stats.stride(1),
            scores.stride(0), out.stride(0),
            CHUNK=chunk, HP=max(16, triton.next_power_of_2(h)), BLOCK_M=tc.block_m,
            BLOCK_S=block_s, BLOCK_W=tc.block_w, num_warps=tc.warps_select,
        )  # fmt: skip
    return out
