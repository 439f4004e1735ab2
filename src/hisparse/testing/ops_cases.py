"""Random inputs for comparing a data-plane ops backend with the reference (`runtime.ops`).

Used by the CPU tests (the CPU backend, the Triton kernels under the interpreter), the GPU tests and
the GPU benchmark (bench_swap), so all draw cases the same way. Imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor
POISON = -7777  # written into outputs first: an unwritten element shows up as this
#: Hot rows `random_hot_state` adds that no request picks start here (never hit).
UNRELATED_ROWS = 10_000_000


@dataclass
class ResolveCase:
    """One call's inputs plus the hot state and poisoned outputs (all on one device)."""

    topk: Tensor
    row_req: Tensor
    request_state_indices: Tensor
    source_block_table: Tensor
    resident_block_table: Tensor | None
    hot_block_table: Tensor
    hot_index: Tensor
    lru: Tensor
    block_size: int
    out_physical: Tensor
    swap_src: Tensor
    swap_dst: Tensor
    swap_count: Tensor
    valid_counts: Tensor | None
    hit_miss: Tensor | None
    meta: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (
            self.topk, self.row_req, self.request_state_indices, self.source_block_table,
            self.resident_block_table, self.hot_block_table, self.hot_index, self.lru,
            self.block_size, self.out_physical, self.swap_src, self.swap_dst, self.swap_count,
            self.valid_counts, self.hit_miss,
        )  # fmt: skip

    def clone(self) -> ResolveCase:
        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.clone()

        return ResolveCase(
            *[c(a) if isinstance(a, Tensor) else a for a in self.args()], meta=dict(self.meta)
        )

    def to(self, device: torch.device | str) -> ResolveCase:
        def m(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return ResolveCase(
            *[m(a) if isinstance(a, Tensor) else a for a in self.args()], meta=dict(self.meta)
        )

    def state_and_outputs(self) -> dict[str, Tensor]:
        out = {
            "out_physical": self.out_physical,
            "swap_src": self.swap_src,
            "swap_dst": self.swap_dst,
            "swap_count": self.swap_count,
            "hot_index": self.hot_index,
            "lru": self.lru,
        }
        if self.valid_counts is not None:
            out["valid_counts"] = self.valid_counts
        if self.hit_miss is not None:
            out["hit_miss"] = self.hit_miss
        return out


def _randint(lo: int, hi: int, size: tuple, g: torch.Generator) -> Tensor:
    return torch.randint(lo, hi, size, generator=g)


def random_hot_state(
    S: int, H: int, g: torch.Generator, fill: float, row_pool: list[Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """A valid hot state: distinct rows (or -1) per slot set, ``lru`` a random permutation.

    ``row_pool[s]`` (optional) holds candidate host rows of slot set ``s`` (those its request
    may pick: they become hits); the rest of the occupied slots hold unrelated rows.
    """
    hot_index = torch.full((S, H), -1, dtype=torch.int32)
    lru = torch.empty((S, H), dtype=torch.int16)
    for s in range(S):
        lru[s] = torch.randperm(H, generator=g).to(torch.int16)
        n_occ = int(fill * H)
        if n_occ == 0:
            continue
        slots = torch.randperm(H, generator=g)[:n_occ]
        cand = torch.empty(0, dtype=torch.long)
        if row_pool is not None and row_pool[s].numel():
            pool = row_pool[s]
            cand = pool[torch.randperm(pool.numel(), generator=g)[: n_occ // 2]]
        # Unrelated rows far above every block table's rows: never hit, always distinct.
        fresh = torch.randperm(4 * H, generator=g)[: n_occ - cand.numel()]
        junk = UNRELATED_ROWS + s * 4 * H + fresh
        hot_index[s, slots] = torch.cat([cand, junk]).to(torch.int32)
    return hot_index, lru


def make_resolve_case(
    *,
    Q: int,
    K: int,
    H: int,
    block_size: int,
    seed: int,
    S: int | None = None,
    max_rows: int = 1,
    nb: int | None = None,
    p_neg: float = 0.05,
    p_dup: float = 0.05,
    p_resident_page: float = 0.1,
    p_pad_req: float = 0.1,
    p_pad_row: float = 0.05,
    hot_fill: float = 0.8,
    reuse: float = 0.9,
    with_resident: bool = True,
    with_optional: bool = True,
    extra_out_rows: int = 0,
    extra_req_rows: int = 0,
    shuffle_rows: bool = True,
    index_dtype: torch.dtype = torch.int32,
) -> ResolveCase:
    """A random resolve_residency call on the CPU (move it with `.to`).

    ``reuse`` of each row's picks come from the rows its request's hot set already holds
    (hits), the rest are fresh positions (misses), then duplicates and -1 are sprinkled in.
    """
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    S = S if S is not None else Q + 2
    nb = nb if nb is not None else max(2, (4 * H) // bs + 2)
    n_pos = nb * bs
    # Requests: distinct state slots, some padding.
    slots = torch.randperm(S, generator=g)[:Q].to(torch.int32)
    pad = torch.rand(Q, generator=g) < p_pad_req
    state = torch.where(pad, torch.full_like(slots, -1), slots)
    # Host blocks: distinct per request (block 0 is the null block, never used).
    host_blocks = 1 + torch.randperm(Q * nb + 7, generator=g)[: Q * nb].view(Q, nb)
    src_bt = host_blocks.to(torch.int32)
    res_bt = None
    if with_resident:
        res = torch.rand(Q, nb, generator=g) < p_resident_page
        res_bt = torch.where(res, _randint(1, 1000, (Q, nb), g), 0).to(torch.int32)
    HB = -(-H // bs)
    hot_bt = (1 + torch.randperm(S * HB + 3, generator=g)[: S * HB]).view(S, HB).to(torch.int32)
    # Hot state: part of each request's possible rows already sit in its slots.
    pools: list[Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(S)]
    cand_pos: list[Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(Q)]
    for q in range(Q):
        pos = torch.randperm(n_pos, generator=g)[: min(n_pos, H)]
        cand_pos[q] = pos
        pools[int(slots[q])] = src_bt[q].long()[pos // bs] * bs + pos % bs
    hot_index, lru = random_hot_state(S, H, g, hot_fill, pools)
    # Rows: each request gets 0..max_rows rows, in shuffled order, plus padding rows.
    row_req_list: list[int] = []
    for q in range(Q):
        row_req_list += [q] * int(torch.randint(0, max_rows + 1, (1,), generator=g))
    n_pad_rows = int(p_pad_row * max(1, len(row_req_list))) + (1 if p_pad_row > 0 else 0)
    row_req_list += [-1] * n_pad_rows
    row_req = torch.tensor(row_req_list, dtype=torch.int32)
    if shuffle_rows:
        row_req = row_req[torch.randperm(row_req.numel(), generator=g)]
    R = row_req.numel()
    topk = torch.full((R, K), -1, dtype=torch.long)
    for r in range(R):
        q = int(row_req[r])
        qq = q if q >= 0 else 0
        n_reuse = int(reuse * K)
        old = cand_pos[qq][torch.randint(0, cand_pos[qq].numel(), (n_reuse,), generator=g)]
        new = torch.randint(0, n_pos, (K - n_reuse,), generator=g)
        row = torch.cat([old, new])[torch.randperm(K, generator=g)]
        dup = torch.rand(K, generator=g) < p_dup
        row = torch.where(dup, row[torch.randint(0, K, (K,), generator=g)], row)
        neg = torch.rand(K, generator=g) < p_neg
        topk[r] = torch.where(neg, -1, row)
    out = torch.full((R + extra_out_rows, K), POISON, dtype=torch.int32)
    case = ResolveCase(
        topk=topk.to(index_dtype),
        row_req=row_req,
        request_state_indices=state,
        source_block_table=src_bt,
        resident_block_table=res_bt,
        hot_block_table=hot_bt,
        hot_index=hot_index,
        lru=lru,
        block_size=bs,
        out_physical=out,
        swap_src=torch.full((Q + extra_req_rows, H), POISON, dtype=torch.int32),
        swap_dst=torch.full((Q + extra_req_rows, H), POISON, dtype=torch.int32),
        swap_count=torch.full((Q + extra_req_rows,), POISON, dtype=torch.int32),
        valid_counts=torch.full((R + extra_out_rows,), POISON, dtype=torch.int32)
        if with_optional
        else None,
        hit_miss=torch.full((Q + extra_req_rows, 2), POISON, dtype=torch.int32)
        if with_optional
        else None,
        meta={"cand_pos": cand_pos, "n_pos": n_pos},
    )
    return case


def shift_host_rows(case: ResolveCase, rows: int) -> ResolveCase:
    """``case`` with every host row ``rows`` higher (a multiple of the block size): source
    blocks and the hot rows taken from them; the unrelated hot rows stay where they are.
    Puts host rows near 2^31 (the int32 limit of the lists) without a host pool."""
    bs = case.block_size
    if rows % bs or rows < 0:
        raise ValueError(f"shift {rows} is not a non-negative multiple of block size {bs}")
    case.source_block_table = case.source_block_table + rows // bs
    held = (case.hot_index >= 0) & (case.hot_index < UNRELATED_ROWS)
    case.hot_index = torch.where(held, case.hot_index + rows, case.hot_index)
    return case


def next_step_topk(case: ResolveCase, seed: int, reuse: float = 0.9) -> Tensor:
    """New picks for the same rows: mostly last step's positions, some fresh (decode drift)."""
    g = torch.Generator().manual_seed(seed)
    topk = case.topk.cpu().long()
    R, K = topk.shape
    n_pos = case.meta["n_pos"]
    keep = torch.rand(R, K, generator=g) < reuse
    fresh = torch.randint(0, n_pos, (R, K), generator=g)
    new = torch.where(keep & (topk >= 0), topk, fresh)
    neg = torch.rand(R, K, generator=g) < 0.03
    new = torch.where(neg, -1, new)
    return new.to(case.topk.dtype).to(case.topk.device)


def compare(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Names of the tensors that differ (exactly: values, dtype and shape)."""
    bad = []
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
            bad.append(k)
    return bad


def random_paged_view(
    num_blocks: int, block_size: int, row_bytes: int, row_stride: int, g: torch.Generator
) -> Tensor:
    """A random paged uint8 view ``[num_blocks, block_size, row_bytes]`` whose rows may sit
    apart (``row_stride > row_bytes``: token-major host layout) and whose blocks are padded,
    at a storage offset: a gather must honour every stride."""
    block_stride = block_size * row_stride + 16
    raw = torch.randint(0, 256, (num_blocks * block_stride + 32,), dtype=torch.uint8, generator=g)
    return raw.as_strided((num_blocks, block_size, row_bytes), (block_stride, row_stride, 1), 16)


def make_invalidate_case(
    seed: int, *, S: int = 5, H: int = 24, Q: int = 4, n: int = 12, rows: int = 40
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(hot_index, request_state_indices, row_req, written_rows) for invalidate_written_slots:
    partly filled slots, one padding request, padding rows and ``-1`` writes, and more
    ``row_req`` entries than written rows (the op reads the common prefix)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.full((S, H), -1, dtype=torch.int32)
    for s in range(S):
        k = int(torch.randint(0, H, (1,), generator=g))
        hot[s, torch.randperm(H, generator=g)[:k]] = torch.randperm(rows, generator=g)[:k].int()
    state = torch.randperm(S, generator=g)[:Q].int()
    state[int(torch.randint(0, Q, (1,), generator=g))] = -1
    row_req = torch.randint(-1, Q, (n + 2,), generator=g).int()
    written = torch.randint(-1, rows, (n,), generator=g).int()
    return hot, state, row_req, written
