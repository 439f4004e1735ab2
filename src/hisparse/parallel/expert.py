"""Expert parallelism under data-parallel attention (docs/design.md §21).

Each data-parallel rank runs attention for its own requests, but a MoE layer runs over every
rank's tokens: rank ``r`` holds whole experts ``[r·E/N, (r+1)·E/N)``. In each forward the ranks
agreed beforehand on a row count ``rows`` (the largest of their batches, `forward_rows`); a
MoE layer pads its tokens to ``rows``, all-gathers the tokens and their routing (fixed
shapes: nothing about the split has to reach the host first), runs its local experts on the
pairs routed to them and reduce-scatters the partial sums back, each rank receiving its own
rows. A rank with nothing to run in a forward still takes part in every MoE layer's
collectives, with no rows of its own (`idle_forward`). Shared experts and dense layers run per
rank on its own tokens.

On gloo the reduce-scatter is an all-to-all whose parts are added in rank order (the same
result whatever gloo's algorithm); NCCL reduces with its own ``reduce_scatter``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch >= 2.13 names the fixed-shape collectives ``*_single`` (the old names warn)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class ExpertParallel:
    """This rank's share of every MoE layer's experts and the collectives that reach them.

    ``group``: the data-parallel ranks (`TPGroup`: ``rank``, ``world_size``, ``group``,
    ``backend``); ``n_experts``: routed experts per layer (divisible by the ranks)."""

    def __init__(self, group: Any, n_experts: int, dtype: torch.dtype) -> None:
        self.rank, self.size = group.rank, group.world_size
        if n_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs the routed experts "
                f"({n_experts}) to divide evenly; pick a data_parallel_size that divides them"
            )
        self.group, self.backend = group.group, group.backend
        self.per = n_experts // self.size
        self.first = self.rank * self.per
        self.dtype = dtype
        #: rows every rank contributes to the forward running now (None: outside one)
        self.rows: int | None = None
        self.moe_layers: list[nn.Module] = []

    # --- installation ---------------------------------------------------------------------
    def install(self, model: nn.Module) -> None:
        """Route every MoE layer of ``model`` through this rank and keep only its own
        experts' weights (the multi-token-prediction layers' too)."""
        from hisparse.models.deepseek_v32 import MoE

        for moe in model.modules():
            if isinstance(moe, MoE):
                self._keep_local(moe)
                moe.ep = self
        model.expert_parallel = self
        # the layers a forward runs, in order: an idle rank joins each one's collectives
        self.moe_layers = [layer.mlp for layer in model.model.layers
                           if isinstance(layer.mlp, MoE)]  # fmt: skip

    def _keep_local(self, moe: nn.Module) -> None:
        lo, hi = self.first, self.first + self.per
        ex = moe.fp8_experts
        if ex is not None and ex.n_experts != self.per:  # loaded whole (a fused checkpoint)
            for name, p in list(ex.named_parameters(recurse=False)):
                setattr(ex, name, nn.Parameter(p.data[lo:hi].clone(), requires_grad=False))
            ex.n_experts, ex.first_expert = self.per, lo
        for e in range(len(moe.experts)):
            if not lo <= e < hi:
                moe.experts[e] = nn.Module()  # no weights: another rank's expert

    # --- a forward ------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_rows(self, rows: int) -> Iterator[None]:
        """Inside: every MoE layer pads its tokens to ``rows`` (agreed by all ranks)."""
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None

    def idle_forward(self) -> None:
        """A forward in which this rank has no tokens: every MoE layer's collectives, in
        order, with padding rows only (the other ranks' tokens still reach its experts)."""
        for moe in self.moe_layers:
            self.forward(moe, torch.zeros(0, moe.gate.weight.shape[1], dtype=self.dtype,
                                          device=moe.gate.weight.device))  # fmt: skip

    def forward(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``moe``'s output for this rank's tokens ``x [n, H]`` (shared experts included)."""
        rows = self.rows
        if rows is None or x.shape[0] > rows:
            raise RuntimeError(
                f"an expert-parallel MoE ran {x.shape[0]} rows outside an agreed forward "
                f"(rows={rows}): every forward must run inside ExpertParallel.forward_rows"
            )
        n, h = x.shape
        k = moe.gate.top_k
        route = torch.full((rows, 2 * k), -1.0, dtype=torch.float32, device=x.device)
        tokens = x.new_zeros(rows, h)
        if n:
            weights, ids = moe.gate(x)
            route[:n, :k] = weights.float()
            route[:n, k:] = ids.float()  # exact: expert ids < 2^24
            tokens[:n] = x
        tokens, route = self._all_gather(tokens), self._all_gather(route)
        w, ids = route[:, :k], route[:, k:].long()
        partial = self._local_experts(moe, tokens, w, ids)
        out = self._reduce_scatter(partial)[:n].to(x.dtype)
        return out + moe.shared_experts(x) if n else out

    def _local_experts(
        self, moe: nn.Module, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """fp32 ``[N·rows, H]``: the weighted sum of this rank's experts for every row routed
        to them (zero elsewhere), each expert's terms as the one-rank loop computes them."""
        local = ids - self.first
        valid = (ids >= 0) & (local >= 0) & (local < self.per)
        if moe.fp8_experts is not None:
            # pairs of other ranks' experts run on expert 0 with weight 0: exact zeros
            return moe.fp8_experts(x, torch.where(valid, w, 0.0), torch.where(valid, local, 0),
                                   out_dtype=torch.float32)  # fmt: skip
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids[valid]).tolist():
            tok, slot = torch.where(ids == e)
            y = moe.experts[e](x[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y.float())
        return out

    # --- collectives ----------------------------------------------------------------------
    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        all_gather_single(out, t.contiguous(), group=self.group)
        return out

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Rank ``r`` gets the sum over ranks of rows ``[r·rows, (r+1)·rows)`` of ``t``."""
        rows = t.shape[0] // self.size
        if self.backend == "nccl":
            out = t.new_empty((rows, *t.shape[1:]))
            _REDUCE_SCATTER(out, t.contiguous(), group=self.group)
            return out
        parts = torch.empty_like(t)
        dist.all_to_all_single(parts, t.contiguous(), group=self.group)
        out = parts[:rows]
        for r in range(1, self.size):
            out = out + parts[r * rows : (r + 1) * rows]
        return out
