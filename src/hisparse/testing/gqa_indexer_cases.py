"""Random decode steps for the fused GQA indexer's tests and benchmarks, poisoned scratch
buffers, the reference scores and what "the same selection" means."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hisparse.attention import gqa_indexer_triton as git
from hisparse.attention.gqa_indexer_reference import (
    GqaIndexerConfig,
    GqaIndexerFormat,
)
from hisparse.config import cdiv

Tensor = torch.Tensor


@contextlib.contextmanager
def poisoned_scratch() -> Iterator[list[tuple[Tensor, Tensor, Tensor]]]:
    """Within the block every scratch buffer the kernels get is NaN-filled first (so a value
    read back that no kernel wrote shows); the yielded list collects them, so a test can read
    the masses (``[-1][2]``)."""
    real, seen = git._scratch, []

    def poisoned(*args):  # type: ignore[no-untyped-def]
        bufs = real(*args)
        for b in bufs:
            b.fill_(float("nan"))
        seen.append(bufs)
        return bufs

    git._scratch = poisoned
    try:
        yield seen
    finally:
        git._scratch = real


@dataclass
class DecodeCase:
    """One random decode step over a paged fp8 index cache (unwritten pages hold NaN bytes)."""

    q: Tensor  # [R, H, D]
    positions: Tensor  # [R] = lengths - 1
    pages: Tensor  # uint8 [NB, block_size * G * D]
    tables: Tensor  # int32 [R, capacity blocks], shuffled blocks
    lengths: Tensor  # [R] on the device
    longest: int  # host bound: max(lengths) or the table's capacity
    fmt: GqaIndexerFormat

    def args(self) -> tuple:
        return (self.q, self.positions, self.pages, self.tables, self.lengths, self.longest,
                self.fmt)  # fmt: skip


def random_decode_case(
    lengths: list[int],
    *,
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 64,
    capacity: int | None = None,
    key_scale: float = 2.0,
    q_dtype: torch.dtype = torch.float32,
    strided: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> DecodeCase:
    """Keys ``randn * key_scale`` written through `write_index_keys` into shuffled blocks;
    ``capacity`` (a multiple of ``block_size``) is the table width in positions and the host
    bound passed as ``longest`` (default: the longest request). ``strided``: the pages are
    every other page of a pool whose other pages hold random bytes (the engine's layers)."""
    from hisparse.attention.gqa_indexer_keys import write_index_keys
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)  # block placement
    dgen = torch.Generator(device=dev).manual_seed(seed)  # values, made on the device
    fmt = GqaIndexerFormat.for_config(GqaIndexerConfig(method="fp8"), kv_heads, head_dim)
    cap = capacity or cdiv(max(lengths), block_size) * block_size
    max_blocks = cdiv(cap, block_size)
    used = sum(cdiv(n, block_size) for n in lengths)
    nb = used + 3
    pb = fmt.page_bytes(block_size)
    u8 = dict(dtype=torch.uint8, device=dev)
    if strided:  # every other page of a pool whose other pages hold random bytes
        pool = torch.randint(0, 256, (nb, 2 * pb), generator=dgen, **u8)
        pages = pool[:, pb:]
        pages.fill_(0xFF)  # NaN
    else:
        pages = torch.full((nb, pb), 0xFF, **u8)  # NaN
    # Unused table entries name block 0, never written (NaN bytes), as in the engine.
    tables = torch.zeros((len(lengths), max_blocks), dtype=torch.int32)
    free = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    for r, n in enumerate(lengths):
        nblk = cdiv(n, block_size)
        tables[r, :nblk] = torch.tensor([free.pop() for _ in range(nblk)], dtype=torch.int32)
    tables = tables.to(dev)
    slots = torch.cat([
        tables[r, torch.arange(n, device=dev) // block_size].long() * block_size
        + torch.arange(n, device=dev) % block_size
        for r, n in enumerate(lengths)
    ])  # fmt: skip
    keys = torch.randn(len(slots), kv_heads, head_dim, generator=dgen, device=dev) * key_scale
    write_index_keys(pages, fmt, slots, keys)
    q = torch.randn(len(lengths), heads, head_dim, generator=dgen, device=dev).to(q_dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    return DecodeCase(q, (lens - 1).long(), pages, tables, lens, cap, fmt)


def reference_scores(case: DecodeCase, cfg: GqaIndexerConfig, scale: float) -> list[Tensor]:
    """Per request, fp32 ``[n]`` scores as `select_topk` ranks them (candidate mass; forced
    ``2H``; requests that fit in ``top_k``: empty), computed request by request."""
    from hisparse.attention.gqa_indexer_keys import read_index_keys
    from hisparse.attention.gqa_indexer_select import approx_logits, forced_mask

    out = []
    h = case.q.shape[1]
    for r, n in enumerate(case.lengths.tolist()):
        if cfg.top_k is None or n <= cfg.top_k:
            out.append(torch.empty(0))
            continue
        pos = case.positions[r : r + 1]
        keys = read_index_keys(case.pages, case.fmt, case.tables[r], n)
        lg = approx_logits(case.q[r : r + 1], keys, case.fmt, scale)[0]  # [H, n]
        forced = forced_mask(pos, n, cfg.sink_tokens, cfg.recent_window)[0]
        cand = ~forced & (torch.arange(n, device=lg.device) <= pos)
        lg = torch.where(cand, lg, float("-inf"))
        lse = torch.logsumexp(lg, dim=-1, keepdim=True)
        mass = torch.exp(lg - torch.where(torch.isfinite(lse), lse, 0.0)).sum(0)
        out.append(torch.where(forced, 2.0 * h, mass).float().cpu())
    return out


def selection_errors(
    got: Tensor,
    want: Tensor,
    case: DecodeCase,
    cfg: GqaIndexerConfig,
    scores: list[Tensor],
    rtol: float,
    atol: float,
) -> list[str]:
    """Why ``got`` is not an acceptable top-k where ``want`` is the reference's ([] if it is).

    Rows that fit in ``top_k`` must equal ``want`` exactly. Scored rows: ``-1`` only as a
    suffix, strictly ascending positions below the length, as many as ``want``, every forced
    position present, and any position in one set but not the other a candidate whose
    reference score is within ``tol = atol + rtol * kth`` of the k-th kept candidate score
    (``kth``), i.e. a near-tie the two summation orders may break differently.
    """
    errs: list[str] = []
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != torch.int32:
        return [f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)}"]
    for r, n in enumerate(case.lengths.tolist()):
        g_row, w_row = got[r], want[r]
        if cfg.top_k is None or n <= cfg.top_k:
            if not torch.equal(g_row, w_row):
                errs.append(f"row {r} (dense, n={n}) differs")
            continue
        valid = g_row >= 0
        count = int(valid.sum())
        if count == 0 or not bool(valid[:count].all()) or bool(valid[count:].any()):
            errs.append(f"row {r}: -1 not a suffix or empty")
            continue
        picked = g_row[:count]
        if count > 1 and not bool((picked[1:] > picked[:-1]).all()):
            errs.append(f"row {r}: not strictly ascending")
        if int(picked.max()) >= n:
            errs.append(f"row {r}: position past the length {n}")
            continue
        w_set = set(w_row[w_row >= 0].tolist())
        g_set = set(picked.tolist())
        if len(g_set) != len(w_set):
            errs.append(f"row {r}: {len(g_set)} picks, reference {len(w_set)}")
        sc = scores[r]
        forced = sc > case.q.shape[1]
        if not set(torch.nonzero(forced).flatten().tolist()) <= g_set:
            errs.append(f"row {r}: a forced position is missing")
        kept_c = [s for s in w_set if not bool(forced[s])]
        if not kept_c:
            continue
        kth = float(sc[kept_c].min())
        tol = atol + rtol * abs(kth)
        for s in g_set ^ w_set:
            if bool(forced[s]) or abs(float(sc[s]) - kth) > tol:
                errs.append(
                    f"row {r}: position {s} (score {float(sc[s]):.6g}) differs, kth {kth:.6g}"
                )
                break
    return errs
