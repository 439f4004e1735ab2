"""The warm start (docs/design.md §5.3, §6.7): a request that finishes its prompt would miss
every row of its first decode step; instead its hot buffers are seeded, from the host pool,
with the rows its prompt's last token selected in the prefill step, since consecutive steps
select mostly the same rows. One object per prefill step records those selections as the
leaders compute them (or takes the step hooks' replayed ones) and seeds the hot buffers of
the requests that read through them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hisparse.runtime.batch import StepMetadata

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner


class WarmStart:
    """The requests of one prefill step that finish their prompt (batch rows ``rows``, their
    last tokens at token rows ``token_rows``) and their leaders' selections."""

    def __init__(self, runner: ModelRunner, rows: list[int], token_rows: list[int]) -> None:
        dev = runner.device
        self.runner, self.rows = runner, rows
        self._rows_t = torch.tensor(rows, device=dev)
        self._token_rows = torch.tensor(token_rows, device=dev)
        #: leader name -> ``[len(rows), top_k]`` logical selections
        self.topk: dict[str, torch.Tensor] = {}

    @classmethod
    def for_step(
        cls, runner: ModelRunner, finishing: list[bool], last_rows: list[int]
    ) -> WarmStart | None:
        """The step's warm start: HiSparse prompts that finish here, or every finishing prompt
        where the step hooks replace the top-k (both placements alike); ``None`` if none."""
        hooks = runner.hooks
        replay = hooks is not None and hooks.replaces_topk
        if not (runner.kv.hisparse or replay):
            return None
        rows = [r for r, f in enumerate(finishing) if f]
        return cls(runner, rows, [last_rows[r] - 1 for r in rows]) if rows else None

    def hooked(self, leader_name: str) -> torch.Tensor | None:
        """The step hooks' selection for these requests (`StepHooks.warm_topk`), if any."""
        runner = self.runner
        if runner.hooks is None:
            return None
        reqs = runner.step_requests().pick(self._rows_t)
        return runner.hooks.warm_topk(runner.leader_index[leader_name], reqs)

    def record(self, leader_name: str, logical_topk: torch.Tensor) -> torch.Tensor:
        """A leader's prefill selection ``[tokens, top_k]``: the finishing requests' last-token
        rows are kept (replaced by the hooks' where they give one, which is what the step then
        attends to)."""
        hooked = self.hooked(leader_name)
        if hooked is not None:
            logical_topk = logical_topk.clone()
            logical_topk[self._token_rows] = hooked[:, : logical_topk.shape[1]]
        self.topk[leader_name] = logical_topk[self._token_rows].clone()
        return logical_topk

    def record_hooked(self) -> None:
        """A synthetic prefill computes no selection: every leader takes the hooks'."""
        for leader in self.runner.leaders:
            name = leader.runtime.name
            topk = self.hooked(name)
            if topk is not None:
                self.topk[name] = topk

    def seed(
        self, req_ids: list[str], ends: list[int], slots: torch.Tensor, host_bt: torch.Tensor
    ) -> None:
        """Seed, from the host pool, the hot buffers of the finishing requests that read
        through them (`KVBlockManager.needs_warm_start`: not those whose pages all stayed
        resident); ``req_ids`` / ``ends`` / ``slots`` / ``host_bt`` are the step's, by batch
        row."""
        runner = self.runner
        kv = runner.kv
        if not kv.hisparse or not self.topk:
            return
        cold = [i for i, r in enumerate(self.rows) if kv.needs_warm_start(req_ids[r], ends[r])]
        if not cold:
            return
        dev = runner.device
        m = len(cold)
        pick = torch.tensor([self.rows[i] for i in cold], device=dev)
        sub = None if m == len(self.rows) else torch.tensor(cold, device=dev)
        meta = StepMetadata(
            num_tokens=m,
            is_decode=True,
            req_per_token=torch.arange(m, dtype=torch.int32, device=dev),
            request_state_indices=slots[pick].to(torch.int32),
            source_block_table=host_bt[pick],
        )
        for leader in runner.leaders:
            topk = self.topk.get(leader.runtime.name)
            if topk is not None:
                leader.runtime.group.warm_start_from_host(meta, topk if sub is None else topk[sub])
