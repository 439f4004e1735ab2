"""An independent plain-Python model of the sparse KV cache's runtime, for
tests/test_runtime_property.py's state machine, and the helpers that read and write the
runtime's tensors as the model's bytes.

The model knows nothing of the runtime's code: it implements the rules of docs/design.md §6
from the text with lists and dicts, and keeps a byte-exact copy of every host and device
tensor, so any write the runtime does that the contract does not call for shows up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Resolved:
    """What one resolve produces, per the contract."""

    physical: list[list[int]]
    valid: list[int]
    swaps: dict[int, list[tuple[int, int]]]  # request -> [(host row, hot physical row)]
    hit_miss: dict[int, tuple[int, int]]


class HotModel:
    """One index group's hot state: ``hot[s][h]`` host row or -1, ``lru[s]`` oldest first."""

    def __init__(self, num_slots: int, hot_size: int, bs: int, hot_bt: list[list[int]]) -> None:
        self.H = hot_size
        self.bs = bs
        self.hot_bt = hot_bt
        self.hot = [[-1] * hot_size for _ in range(num_slots)]
        self.lru = [list(range(hot_size)) for _ in range(num_slots)]
        #: Write generation of the host row when it was copied into the slot.
        self.copied_gen = [[-1] * hot_size for _ in range(num_slots)]
        self.totals = [0, 0, 0]

    def hot_row(self, s: int, h: int) -> int:
        return self.hot_bt[s][h // self.bs] * self.bs + h % self.bs

    def reset(self, s: int) -> None:
        self.hot[s] = [-1] * self.H
        self.lru[s] = list(range(self.H))
        self.copied_gen[s] = [-1] * self.H

    def invalidate(self, s: int, rows: set[int]) -> None:
        for h, g in enumerate(self.hot[s]):
            if g in rows:
                self.hot[s][h] = -1
                self.copied_gen[s][h] = -1

    def resolve(
        self,
        topk: list[list[int]],
        row_req: list[int],
        state: list[int],
        src_bt: list[list[int]],
        res_bt: list[list[int]] | None,
        gen: dict[int, int],
    ) -> Resolved:
        """Rules 1-6 of resolve_residency, request by request."""
        bs = self.bs
        physical = [[-1] * len(r) for r in topk]
        valid = [0] * len(topk)
        swaps: dict[int, list[tuple[int, int]]] = {}
        hit_miss: dict[int, tuple[int, int]] = {}
        for q, s in enumerate(state):
            if s < 0:
                continue
            my_rows = [i for i, rq in enumerate(row_req) if rq == q]
            wanted: list[int] = []
            seen: set[int] = set()
            entries: list[tuple[int, int, int]] = []  # (row, col, host row) needing hot
            for i in my_rows:
                for j, p in enumerate(topk[i]):
                    if p < 0:
                        continue
                    valid[i] += 1
                    page, off = divmod(p, bs)
                    g = src_bt[q][page] * bs + off
                    if res_bt is not None and res_bt[q][page] != 0:
                        physical[i][j] = res_bt[q][page] * bs + off
                        continue
                    entries.append((i, j, g))
                    if g not in seen:
                        seen.add(g)
                        wanted.append(g)
            assert len(wanted) <= self.H, "test generated more wanted rows than H"
            if not wanted:
                continue
            held = {g: h for h, g in enumerate(self.hot[s]) if g >= 0}
            hit_slots = {held[g] for g in wanted if g in held}
            evictable = [h for h in self.lru[s] if h not in hit_slots]
            slot_of: dict[int, int] = {}
            filled: list[int] = []
            for g in wanted:
                if g in held:
                    slot_of[g] = held[g]
                else:
                    h = evictable[len(filled)]
                    filled.append(h)
                    slot_of[g] = h
                    self.hot[s][h] = g
                    self.copied_gen[s][h] = gen[g]
            self.lru[s] = (
                evictable[len(filled) :] + filled + [h for h in self.lru[s] if h in hit_slots]
            )
            for i, j, g in entries:
                physical[i][j] = self.hot_row(s, slot_of[g])
            misses = [g for g in wanted if g not in held]
            swaps[q] = sorted((g, self.hot_row(s, slot_of[g])) for g in misses)
            hit_miss[q] = (len(wanted) - len(misses), len(misses))
        return Resolved(physical, valid, swaps, hit_miss)


class Memory:
    """Byte-exact copy of one layer's host view and device view."""

    def __init__(self, host: bytes, dev: bytes, row_bytes: int) -> None:
        self.host = bytearray(host)
        self.dev = bytearray(dev)
        self.W = row_bytes

    def get(self, buf: bytearray, row: int) -> bytes:
        return bytes(buf[row * self.W : (row + 1) * self.W])

    def put(self, buf: bytearray, row: int, data: bytes) -> None:
        assert len(data) == self.W
        buf[row * self.W : (row + 1) * self.W] = data


@dataclass
class Req:
    """A live request of the scenario."""

    slot: int
    blocks: list[int]  # host block per page
    resident: list[int]  # GPU block per page, 0 = host only
    seq_len: int  # accepted tokens
    recent: list[int] = field(default_factory=list)  # last selections, for reuse (hits)


def view_bytes(view: torch.Tensor) -> bytes:
    """Every byte of ``view``, in order."""
    return view.contiguous().numpy().tobytes()


def row_bytes(view: torch.Tensor, row: int) -> bytes:
    """The bytes of flat row ``row`` of a paged ``[blocks, block_size, W]`` view."""
    bs = view.shape[1]
    return view[row // bs, row % bs].numpy().tobytes()


def set_row(view: torch.Tensor, row: int, data: bytes) -> None:
    """Write flat row ``row`` of a paged view."""
    bs = view.shape[1]
    view[row // bs, row % bs] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def int32s(values: list[int] | list[list[int]]) -> torch.Tensor:
    """An int32 tensor of ``values`` (the runtime's index dtype)."""
    return torch.tensor(values, dtype=torch.int32)
