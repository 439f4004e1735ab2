"""Benchmark-only top-k source: replayed selections with a set step-to-step overlap.

Random weights make the indexer choose unrelated tokens every step, which no trained model
does, so a benchmark on random checkpoints would measure a hot buffer that never hits. The
replay overrides the logical top-k an index-group leader hands to the runtime (the indexer
still runs; its choice is discarded): a request's first selection is ``top_k - 1`` earlier
positions (stratified random sampling: one per equal stratum) plus the newest token; each next
step keeps ``round(overlap * top_k)`` entries of the previous selection (capped at
``top_k - 1``) and fills the rest with positions the previous selection did not hold, the
newest token always included. When too few such positions exist, more of the previous
selection is kept; short contexts (``length <= top_k``) select every position, as the indexer
does. A previous selection never repeats a position (the mapping below relies on it).

Every random choice is a counter-based hash of (seed, request key, leader, length, index),
computed on the device with integer ops, so both placements (and CPU and GPU) see exactly
the same selections whatever the batch composition. The fresh positions are drawn by
stratified sampling of ranks in the complement of the previous selection (one rank per
equal stratum, so they are distinct by construction) and mapped to positions with one
`searchsorted` over the sorted previous selection: a step costs O(rows * top_k), never
O(rows * context) -- the replay is measurement scaffolding and must not weigh on the step
it measures (a 128K context made the earlier whole-context sort cost more than the
indexer's own top-k).
"""

from __future__ import annotations

import torch

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B
_STRIDE = 40503
#: bits of the position in a sort key: contexts up to 2M tokens
POS_BITS = 21
_POS_MASK = (1 << POS_BITS) - 1
_HASH_SHIFT = POS_BITS
_BIG = torch.iinfo(torch.int64).max


def mix31(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of int64 values in ``[0, 2**31)`` to ``[0, 2**31)`` (no overflow)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def mix31_int(x: int) -> int:
    """`mix31` on a Python int (same values)."""
    x &= _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def hash_rows(base: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` hashes of (row base ``[R]``, column value ``cols [N]`` or ``[R, N]``)."""
    c = cols if cols.dim() == 2 else cols[None, :]
    return mix31((base[:, None] + (c & _M31) * _STRIDE) & _M31)


def salt_of(seed: int, salt: int) -> int:
    """The scalar that `row_bases` mixes into every row of (seed, salt)."""
    return mix31_int(mix31_int(seed) ^ mix31_int(salt + 0x1234567))


def row_bases(seed: int, salt: int, keys: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Per-row hash base of (seed, salt, request key, current length): int64 ``[R]``."""
    return mix31(mix31((keys & _M31) ^ salt_of(seed, salt)) ^ (lens & _M31))


def replay_hash(
    seed: int, salt: int, keys: torch.Tensor, lens: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """``hash_rows(row_bases(seed, salt, keys, lens), cols)``; one fused kernel on CUDA."""
    if cols.device.type == "cuda":
        # imported here: importing Triton early (before TRITON_INTERPRET is set) would change
        # how other modules' kernels run under the CPU interpreter
        from hisparse.bench.replay_triton import replay_hash_triton

        return replay_hash_triton(seed, salt, keys, lens, cols)
    return hash_rows(row_bases(seed, salt, keys, lens), cols)


def replay_step(
    prev: torch.Tensor,
    lens: torch.Tensor,
    keys: torch.Tensor,
    *,
    seed: int,
    leader: int,
    keep: int,
    max_len: int,
) -> torch.Tensor:
    """The next selection of each row: int32 ``[R, K]`` (``-1`` padded).

    Column 0 is the newest position, then the kept entries of ``prev`` (in hash order), then
    the fresh ones.

    Args:
        prev: int32 ``[R, K]`` the previous selection (``-1`` entries: none; all ``-1``:
            first selection of the request).
        lens: int64 ``[R]`` tokens each request holds including the new one (the newest
            position is ``lens - 1``).
        keys: int64 ``[R]`` request keys (stable across placements).
        keep: entries of ``prev`` to keep (``<= K - 1``).
        max_len: ``max(lens)`` as a Python int (only checked: no device sync).
    """
    K = prev.shape[1]
    dev = prev.device
    if max_len >= 1 << POS_BITS:
        raise ValueError(f"top-k replay handles contexts below {1 << POS_BITS} tokens")
    older = (lens - 1)[:, None]  # positions [0, older) are candidates; the newest is added
    p = prev.long()
    valid = (p >= 0) & (p < older)
    n_valid = valid.sum(1, keepdim=True)
    col = torch.arange(K - 1, device=dev, dtype=torch.int64)[None, :]
    # the previous selection in hash order: its first `n_keep` entries are kept
    khash = replay_hash(seed, 2 * leader + 1, keys, lens, p)
    kkey = torch.where(valid, (khash << _HASH_SHIFT) | p, _BIG)
    old = torch.sort(kkey, dim=1).values[:, : K - 1] & _POS_MASK
    room = (older - n_valid).clamp_min(0)  # earlier positions the previous selection lacks
    n_keep = torch.minimum((K - 1 - room).clamp_min(keep), n_valid)
    n_fresh = torch.minimum(K - 1 - n_keep, room)
    # fresh ranks in [0, room): one per equal stratum, so distinct without a sort
    m = n_fresh.clamp_min(1)
    lo = col * room // m
    hi = (col + 1) * room // m
    rank = lo + replay_hash(seed, 2 * leader, keys, lens, col[0]) % (hi - lo).clamp_min(1)
    # rank -> position: skip the previous selection's positions below it
    taken = torch.sort(torch.where(valid, p, _BIG), dim=1).values
    gaps = torch.where(taken != _BIG, taken - torch.arange(K, device=dev), _BIG)
    fresh = rank + torch.searchsorted(gaps, rank, right=True)
    i = (col - n_keep).clamp(0, K - 2)
    body = torch.where(col < n_keep, old, fresh.gather(1, i))
    body = torch.where(col < n_keep + n_fresh, body, -1)
    return torch.cat(((lens - 1)[:, None], body), dim=1).to(torch.int32)


class TopKReplay:
    """Replayed selections per (leader, hot-state slot); state lives on the device.

    Args:
        top_k: selection width (the engine's top_k).
        overlap: fraction of the previous selection each step keeps (0..1).
        seed: selections are a function of (seed, request key, leader, length).
        num_leaders: index-group leaders of the model.
        max_slots: hot-state slots (the engine passes max_num_seqs + 1: the spare slot is
            the one padded decode rows read and write).
    """

    def __init__(
        self,
        *,
        top_k: int,
        overlap: float,
        seed: int,
        num_leaders: int,
        max_slots: int,
        device: torch.device,
    ) -> None:
        if not 0.0 <= overlap <= 1.0:
            raise ValueError(f"top-k overlap {overlap} must be between 0 and 1")
        self.top_k, self.overlap, self.seed = top_k, overlap, seed
        self.keep = min(round(overlap * top_k), top_k - 1)
        self.prev = torch.full(
            (num_leaders, max_slots, top_k), -1, dtype=torch.int32, device=device
        )
        #: optional record of every selection made: (leader, request key, length, [K] tensor)
        self.log: list[tuple[int, int, int, torch.Tensor]] | None = None

    def reset_slot(self, slot: int) -> None:
        """A new request takes ``slot``: its next selection is a first selection."""
        self.prev[:, slot] = -1

    def select(
        self,
        leader: int,
        slots: torch.Tensor,
        lens: torch.Tensor,
        keys: torch.Tensor,
        max_len: int,
    ) -> torch.Tensor:
        """Next selection ``[R, K]`` int32 of requests in ``slots`` (int64 device tensors)."""
        prev = self.prev[leader].index_select(0, slots)
        out = replay_step(
            prev, lens, keys, seed=self.seed, leader=leader, keep=self.keep, max_len=max_len
        )
        self.prev[leader].index_copy_(0, slots, out)
        if self.log is not None:
            for r, (k, n) in enumerate(zip(keys.tolist(), lens.tolist(), strict=True)):
                self.log.append((leader, int(k), int(n), out[r].cpu()))
        return out
