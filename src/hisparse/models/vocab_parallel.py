"""Vocabulary-parallel embedding and LM head (tensor parallelism, design §18.2).

Each of N ranks keeps ``ceil(V / N)`` rows of the embedding and of the LM head (the last rank's
tail rows past the vocabulary are zero), instead of the whole ``V x h`` twice: 3.2 GiB a rank
less for DeepSeek-V3.2 in bf16 at 8 ranks. The embedding looks up the ids in its range (zero
rows elsewhere) and all-reduces: exactly one rank contributes each row, so the sum is the
row itself, bit for bit. The LM head computes its rows' logits and gathers them on rank 0,
which samples; the other ranks return ``[rows, 0]`` (every rank calls it, as every rank runs
the step). Without a group (a rank loaded on its own, in tests) no collective runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def vocab_rows(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """``(first row, rows kept, rows of the vocabulary among them)`` of rank ``rank``."""
    per = -(-vocab // world)
    first = rank * per
    return first, per, max(0, min(per, vocab - first))


class _VocabRows(nn.Module):
    """This rank's rows of a ``[vocab, dim]`` weight (`vocab_rows`), and the group."""

    def __init__(self, vocab: int, dim: int, rank: int, world: int, tp: Any = None) -> None:
        super().__init__()
        self.vocab, self.rank, self.world = vocab, rank, world
        self.first, self.rows, self.real_rows = vocab_rows(vocab, rank, world)
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)
        self.tp = tp

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, rows [{self.first}, {self.first + self.rows}) of {self.world}"


class VocabParallelEmbedding(_VocabRows):
    """This rank's rows of an embedding; `forward` all-reduces over ``tp`` (module docstring)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = torch.where(mine.unsqueeze(-1), out, 0.0)
        return self.tp.all_reduce(out) if self.tp is not None else out


class VocabParallelHead(_VocabRows):
    """This rank's rows of the LM head; `forward` gathers the logits on rank 0."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits on rank 0, ``[N, 0]`` elsewhere (``[N, rows]`` without a group)."""
        local = F.linear(hidden, self.weight).contiguous()
        tp = self.tp
        if tp is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=tp.group)
        if parts is None:
            return hidden.new_empty((hidden.shape[0], 0))
        return torch.cat(parts, dim=-1)[:, : self.vocab]
