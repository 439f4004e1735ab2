"""Benchmark-only top-k source: replayed selections with a set step-to-step overlap.

Random weights make the indexer choose unrelated tokens every step, which no trained model
does, so a benchmark on random checkpoints would measure a hot buffer that never hits. The
replay overrides the logical top-k an index-group leader hands to the runtime (the indexer
still runs; its choice is discarded): a request's first selection is ``top_k - 1`` random
earlier positions plus the newest token; each next step keeps ``round(overlap * top_k)``
entries of the previous selection (capped at ``top_k - 1``) and fills the rest with positions
the previous selection did not hold, the newest token always included. Short contexts
(``length <= top_k``) select every position, as the indexer does.

Every random choice is a counter-based hash of (seed, request key, leader, length, position),
computed on the device with integer ops, so both placements (and CPU and GPU) see exactly
the same selections whatever the batch composition, and no step does O(context) Python.
Ties cannot happen: each candidate's sort key is unique (class, hash, position).
"""

from __future__ import annotations

import torch

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B
_STRIDE = 40503
#: bits of the position in a sort key: contexts up to 2M tokens
POS_BITS = 21
_HASH_SHIFT = POS_BITS
_CLASS_SHIFT = POS_BITS + 31
_KEPT, _FRESH, _DROPPED, _INVALID = 0, 1, 2, 3


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


def row_bases(seed: int, salt: int, keys: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Per-row hash base of (seed, salt, request key, current length): int64 ``[R]``."""
    s = mix31_int(mix31_int(seed) ^ mix31_int(salt + 0x1234567))
    return mix31(mix31((keys & _M31) ^ s) ^ (lens & _M31))


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

    Args:
        prev: int32 ``[R, K]`` the previous selection (``-1`` entries: none; all ``-1``:
            first selection of the request).
        lens: int64 ``[R]`` tokens each request holds including the new one (the newest
            position is ``lens - 1``).
        keys: int64 ``[R]`` request keys (stable across placements).
        keep: entries of ``prev`` to keep (``<= K - 1``).
        max_len: ``max(lens)`` as a Python int (sizes the candidate range; no device sync).
    """
    R, K = prev.shape
    dev = prev.device
    if max_len >= 1 << POS_BITS:
        raise ValueError(f"top-k replay handles contexts below {1 << POS_BITS} tokens")
    n_old = max(max_len - 1, 1)
    older = lens[:, None] - 1  # positions [0, older) are candidates; the newest is added
    j = torch.arange(n_old, device=dev, dtype=torch.int64)
    base = row_bases(seed, 2 * leader, keys, lens)
    cls = torch.where(j[None, :] < older, _FRESH, _INVALID).to(torch.int64)
    cls = torch.cat((cls, torch.full((R, 1), _INVALID, dtype=torch.int64, device=dev)), dim=1)
    p = prev.long()
    valid = (p >= 0) & (p < older)
    dummy = torch.full_like(p, n_old)
    cls.scatter_(1, torch.where(valid, p, dummy), _DROPPED)
    if keep > 0:
        kbase = row_bases(seed, 2 * leader + 1, keys, lens)
        big = torch.iinfo(torch.int64).max
        kkey = torch.where(valid, (hash_rows(kbase, p) << _HASH_SHIFT) | p, big)
        chosen = torch.topk(kkey, min(keep, K), dim=1, largest=False).values
        ok = chosen != big
        cls.scatter_(1, torch.where(ok, chosen & ((1 << POS_BITS) - 1), n_old), _KEPT)
    score = (cls[:, :n_old] << _CLASS_SHIFT) | (hash_rows(base, j) << _HASH_SHIFT) | j[None, :]
    k1 = min(K - 1, n_old)
    out = torch.full((R, K), -1, dtype=torch.int32, device=dev)
    out[:, 0] = (lens - 1).to(torch.int32)
    if k1 > 0:
        best = torch.topk(score, k1, dim=1, largest=False).values
        pos = torch.where((best >> _CLASS_SHIFT) < _INVALID, best & ((1 << POS_BITS) - 1), -1)
        out[:, 1 : 1 + k1] = pos.to(torch.int32)
    return out


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
