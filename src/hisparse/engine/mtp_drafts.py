"""The MTP proposer on the runner's side: the checkpoint's multi-token-prediction layer
(`models.mtp.MtpLayer`) as one more attention layer of the KV layout, and its drafts.

Its row at position ``i`` pairs the main model's hidden state ``h_i`` with the token
``x_{i+1}`` (design §12.11), so it is written in two places:

- **in every forward** (`MtpDrafter.write_rows`), after the main model, over the same rows
  (positions, slots, the prefill staging area): each row with the token after it where that
  is known (a prompt chunk's next prompt token, a verifying row's next draft) and a filler
  where it is not (a final chunk's or a step's last row). A row whose next token was a
  filler or a refused draft is rewritten by the request's next decode step before anything
  reads it: nothing reads a position past the request's length, and the rewrite drops its hot
  copies (`invalidate_written_slots`, as for the main model's refused rows);
- **at the start of each decode step** (`MtpDrafter.draft`): the row at ``c - 1`` (``c`` the
  request's computed length) from the kept ``h_{c-1}`` (`keep`: the main model's hidden state
  of the last accepted row) and the step's input token ``x_c`` gives the first draft; then k - 1
  one-row steps of the MTP layer alone at ``c .. c + k - 2``, each from the row before's
  normed output (`MtpLayer.head`) and draft. Every position written lies below
  ``c + 1 + k``, where the scheduler grew the request for this step's rows, so no page is
  taken for the drafts' rows.

Drafts are the MTP logits' argmax (vLLM's and SGLang's MTP drafts), so verification with a
point-mass draft keeps every request's output distribution (`spec_verify`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hisparse.engine.request import Request
from hisparse.engine.step_cache import StepCache
from hisparse.kv.specs import LayerCacheSpec
from hisparse.models.kv_access import ForwardStep
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.validation import HiSparseConfigError

if TYPE_CHECKING:
    from hisparse.engine.model_runner import ModelRunner

#: the token filling a row whose next token is not known yet (its row is rewritten)
FILLER = 0


class MtpDrafter:
    """Runs the MTP layer for ``runner`` (module docstring)."""

    @classmethod
    def of(cls, runner: ModelRunner, specs: Sequence[LayerCacheSpec]) -> MtpDrafter | None:
        """A drafter where ``specs`` hold the MTP layer's rows (`registry.engine_specs` with
        an MTP `SpeculativeConfig`), else ``None``."""
        layers = getattr(runner.model, "mtp", None)
        if not layers or f"layers.{layers[0].self_attn.layer}.attn" not in {s.name for s in specs}:
            return None
        if runner.hooks is not None:  # a benchmark's hooks replay one selection per request
            raise HiSparseConfigError("step hooks (hisparse bench) with MTP drafts: not built; "
                                      "run without speculative_config")  # fmt: skip
        return cls(runner)

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.layer = self.model.mtp[0]
        self.index = self.layer.self_attn.layer
        self.name = f"layers.{self.index}.attn"
        #: the latest forward's main hidden states and each request's first row there
        self._hidden: torch.Tensor | None = None
        self._rows: list[tuple[Request, int, int]] = []

    # --- in every forward ------------------------------------------------------------------
    @staticmethod
    def next_tokens(
        batch: Sequence[tuple[Request, int]], decode: bool, drafts: list[list[int]] | None
    ) -> list[int]:
        """Per row of the step, the token after it (`FILLER` where not known yet)."""
        ids: list[int] = []
        for i, (req, n) in enumerate(batch):
            if drafts is not None:
                ids.extend(drafts[i])
                ids.append(FILLER)
            elif decode:
                ids.extend([FILLER] * n)
            else:
                nxt = req.token_slice(req.num_computed + 1, n)
                ids.extend(nxt + [FILLER] * (n - len(nxt)))
        return ids

    def write_rows(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        step: ForwardStep,
        cache: Any,
        batch: Sequence[tuple[Request, int]],
    ) -> None:
        """The MTP layer's rows of this forward (its attention only: the rows are what the
        later drafts read); keeps ``hidden`` for `keep`."""
        self.layer(self.model, hidden, next_ids, step, cache, rows_only=True)
        self._hidden, self._rows, at = hidden, [], 0
        for req, n in batch:
            self._rows.append((req, at, n))
            at += n

    def keep(self, accepted: list[list[int]] | None) -> None:
        """Each request's hidden state at its last computed row, for its next drafts: the
        last row of its tokens, or of its last accepted draft (``accepted``)."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return
        rows = [
            at + (len(accepted[i]) if accepted is not None else n - 1)
            for i, (_, at, n) in enumerate(self._rows)
        ]
        kept = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        for (req, _, _), h in zip(self._rows, kept.unbind(0), strict=True):
            req.mtp_hidden = h
        self._rows = []

    # --- at the start of a decode step -------------------------------------------------------
    def draft(self, batch: Sequence[tuple[Request, int]], drafts: list[list[int]] | None) -> None:
        """Fill ``drafts`` (the scheduler's placeholders, in batch order) with the MTP
        layer's drafts, and rewrite each request's row at ``c - 1`` (module docstring)."""
        reqs = [req for req, _ in batch]
        want = [len(d) for d in drafts] if drafts is not None else [0] * len(reqs)
        for req in reqs:
            if req.mtp_hidden is None:
                raise RuntimeError(f"request {req.req_id}: no hidden state kept for MTP drafts")
        live = list(range(len(reqs)))
        hidden = torch.stack([req.mtp_hidden for req in reqs])
        ids = [req.token_slice(req.num_computed, 1)[0] for req in reqs]
        depth = 0
        while live:
            g = self._one_row([reqs[i] for i in live], depth, ids, hidden)
            more = [j for j, i in enumerate(live) if want[i] > depth]
            if not more:
                return
            # rows of `more` from here on (a request without drafts ran its row at c - 1 only)
            normed, logits = self.layer.head(self.model, g.index_select(0, _rows(more, g)))
            toks = logits.argmax(-1).tolist()
            for m, j in enumerate(more):
                drafts[live[j]][depth] = int(toks[m])  # type: ignore[index]
            go = [m for m, j in enumerate(more) if want[live[j]] > depth + 1]
            hidden = normed.index_select(0, _rows(go, normed))
            ids = [toks[m] for m in go]
            live = [live[more[m]] for m in go]
            depth += 1

    def _one_row(
        self, reqs: list[Request], depth: int, ids: list[int], hidden: torch.Tensor
    ) -> torch.Tensor:
        """One step of the MTP layer alone: a row per request at ``num_computed - 1 +
        depth`` (a decode step's metadata bound to its index group only); outputs ``g``."""
        r = self.runner
        kv, bs, dev = r.kv, r.config.block_size, r.device
        n = len(reqs)
        pos_l = [req.num_computed - 1 + depth for req in reqs]
        slots_l = [kv.requests[req.req_id].slot for req in reqs]
        packed = torch.tensor(pos_l + slots_l + ids, dtype=torch.int64).to(dev)
        pos, slot_d, ids_d = packed.view(3, n)
        rix = torch.arange(n, device=dev)

        def rows_of(table: torch.Tensor) -> torch.Tensor:
            blk = table.long()[rix, pos // bs]
            return torch.where(blk > 0, blk * bs + pos % bs, -1).to(torch.int32)

        host_t, idx_table, res_tables = kv.step_tables(slot_d)
        host_bt = host_t if host_t is not None else r._zero_table[:n]
        meta = StepMetadata(
            num_tokens=n,
            is_decode=True,
            req_per_token=rix.to(torch.int32),
            request_state_indices=slot_d.to(torch.int32),
            source_block_table=host_bt,
            host_slot_mapping=rows_of(host_bt) if kv.hisparse else None,
            all_resident=r._all_resident([req.req_id for req in reqs]),
        )
        table = res_tables[kv.group_of_layer[self.name]]
        r.handles[self.index].prepare_group_for_batch(meta, GroupTables(table, rows_of(table)))
        step = ForwardStep(positions=pos, req_index=rix, seq_lens=pos + 1, max_len=max(pos_l) + 1)
        cache = StepCache(r, True, rows_of(idx_table), idx_table)
        return self.layer(self.model, hidden, ids_d, step, cache)


def _rows(picked: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(picked, dtype=torch.long, device=like.device)
