"""A Llama model's attention layer (`LlamaAttention`): the four steps of the cache protocol
that `hisparse.models.llama`'s docstring lists (this step's rows and compact index keys
written, one logical top-k per token, the rows swapped in, sparse GQA attention over them),
and what every layer reads from a step once per forward (`StepPlan`). Split from the model
(config, caches, the decoder stack) so that the layer reads on its own; its CPU forms are in
`llama_cpu`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.dispatch import (
    gqa_indexer_kernel_takes,
    gqa_indexer_topk_decode,
    sparse_gqa_decode,
    sparse_gqa_kernel_takes,
)
from hisparse.attention.gqa_indexer_keys import write_index_keys
from hisparse.attention.gqa_indexer_reference import (
    GqaIndexerConfig,
    GqaIndexerFormat,
    gqa_indexer_topk,
    gqa_indexer_topk_prefill,
    pad_groups,
)
from hisparse.attention.gqa_indexer_select import selection_masks
from hisparse.attention.sparse_gqa_reference import GqaRowFormat, selected_gqa_varlen_reference
from hisparse.kv.row_formats import write_rows_fast
from hisparse.models import fused
from hisparse.models.kv_access import ForwardStep
from hisparse.models.layers import fused_weight, rope_full_width, rope_half_split
from hisparse.models.llama_cpu import LlamaAttentionCpu, write_rows_cpu

if TYPE_CHECKING:
    from hisparse.models.llama import GqaKVCache, LlamaConfig

#: Step metadata of a packed batch (the same for every model family).
Step = ForwardStep


@dataclass(frozen=True)
class StepPlan:
    """What every layer needs to know about a step's batch, read from the device once per
    forward instead of once per layer (each read is a host sync on CUDA).

    ``decode``: every request has exactly one token (padding tokens aside); ``decode_rows[r]``
    is then request ``r``'s token. Otherwise ``tokens [R, T]`` lists each request's tokens
    (``-1`` padded), the layout of the batched prefill attention.
    ``longest``: the most keys of any request (host int). ``memo``: what the first layer
    derives from the step alone for the others (the batch-1 selection masks). A static
    step (`ForwardStep.static`: a padded decode batch, possibly under CUDA-graph capture) reads
    nothing from the device:
    row ``r`` is request ``r`` (padding rows have ``req_index < 0``), ``lens`` is unknown
    (``None``) and ``longest`` is the step's host bound ``max_len``.
    """

    lens: list[int] | None
    longest: int
    decode: bool
    decode_rows: torch.Tensor | None
    tokens: torch.Tensor | None
    static: bool = False
    memo: dict[str, object] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, step: Step) -> StepPlan:
        req = step.req_index
        if step.static:
            if step.max_len is None:
                raise ValueError("a static step needs max_len (the host bound on keys)")
            rows = torch.arange(req.shape[0], device=req.device)
            return cls(None, step.max_len, True, rows, None, static=True)
        lens = step.seq_lens.tolist()
        valid = req >= 0
        counts = torch.bincount(req[valid], minlength=len(lens)).tolist()
        longest = max(lens, default=0)
        if lens and all(c == 1 for c in counts):
            rows = torch.full((len(lens),), -1, dtype=torch.long, device=req.device)
            rows[req[valid]] = torch.nonzero(valid).flatten()
            return cls(lens, longest, True, rows, None)
        return cls(lens, longest, False, None, pad_groups(req, len(lens)))


class LlamaAttention(LlamaAttentionCpu, nn.Module):
    #: Tensor parallelism (`hisparse.parallel.shard`): this rank's (query heads, KV heads).
    #: The indexer scores with every head; the rows and attention hold this rank's only.
    tp_heads: tuple[slice, slice] | None = None

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        #: ``lowrank`` indexer: the rotary dims kept per KV head (set by `prepare_indexer`).
        self.register_buffer("index_dims", torch.zeros(0, dtype=torch.long), persistent=False)
        #: q, k, v projections as one weight (`fused_weight`; the CPU).
        self._qkv: tuple[torch.Tensor, tuple[int, ...]] | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: Step,
        cache: GqaKVCache,
        indexer: GqaIndexerConfig,
        plan: StepPlan | None = None,
    ) -> torch.Tensor:
        """``cos, sin``: `Rotary` tables ``[N, D / 2]``, or ``[N, D]`` ones from
        `full_width_rope` (the CPU path: the same values in fewer ops)."""
        n = x.shape[0]
        plan = plan or StepPlan.of(step)
        tp = self.tp_heads
        kv = cache.attention(self.layer)
        view, slots = kv.write_target()
        fmt = cache.indexer_format
        dims = self.index_dims if fmt.method == "lowrank" else None
        idx = cache.indexer(self.layer)
        pages, idx_slots = idx.write_target()
        rows_fmt = cache.row_format

        # 1. this step's rows into the paged cache, and 2. their compact keys (on CUDA with
        # the rotary in one kernel, on the CPU both in one compiled call where it applies),
        # then one logical top-k per token.
        q = qr = self._project_write(x, cos, sin, view, slots, rows_fmt, pages, idx_slots, fmt)
        if q is None:
            q, k, v = self._project(x, cos, sin)
            # this rank's heads (under tensor parallelism the rows hold this rank's KV heads,
            # the keys every head)
            qr, kr = (q, k) if tp is None else (q[:, tp[0]].contiguous(), k[:, tp[1]])
            if tp is not None or not write_rows_cpu(
                k, v, view, slots, pages, idx_slots, rows_fmt, fmt
            ):
                write_rows_fast(view, slots, rows_fmt.pack(kr, v))  # no host sync off the CPU
                # decode: one row per request, written without a boolean select (fewer ops)
                write_index_keys(pages, fmt, idx_slots, k, dims, sync_free=plan.decode)
        kv.finish_kv_update()
        read_pages, table = idx.read_source()
        topk = self._select(q, step, plan, read_pages, table, fmt, indexer, dims)

        # 3./4. physical rows, then sparse attention.
        physical = kv.swap_in(topk)
        out = self._attend(qr, step, plan, view, topk, physical, cache.row_format, indexer)
        return self.o_proj(out.reshape(n, -1))

    def _project_write(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        view: torch.Tensor,
        slots: torch.Tensor,
        rows_fmt: GqaRowFormat,
        pages: torch.Tensor,
        idx_slots: torch.Tensor,
        fmt: GqaIndexerFormat,
    ) -> torch.Tensor | None:
        """The fused form (CUDA, fp8 index keys, no tensor parallelism) of `_project` and
        the writes: one matmul over the stacked weight, then `fused.gqa_rope_write` (the
        rotary, the K/V rows and the index keys in one kernel); the rotated queries, or None
        where it does not apply."""
        qkv = self._qkv  # stacked by `LlamaForCausalLM.prepare_fused` (CUDA)
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if (
            self.tp_heads is not None
            or fmt.method != "fp8"
            or cos.shape[-1] * 2 != self.head_dim  # the CPU path's full-width angles
            or not fused.fused_on(x)
            or qkv is None
            or tuple(m.weight.data_ptr() for m in mods) != qkv[1]
        ):
            return None
        out = F.linear(x, qkv[0])
        return fused.gqa_rope_write(
            out, self.n_heads, cos, sin, view, slots, rows_fmt, pages, idx_slots, fmt
        )

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated ``q [N, H, D]``, ``k [N, G, D]`` and ``v [N, G, D]``. The fused forms
        (CUDA): one matmul over the stacked weight, then the rotary kernel for q and for k. On
        the CPU the three projections are one matmul too (`fused_weight`; the same bits as
        three on this BLAS, any row count) and q and k rotate together (elementwise: the same
        bits)."""
        n, H, G, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        rope = rope_full_width if cos.shape[-1] == D else rope_half_split
        qkv = self._qkv  # stacked by `LlamaForCausalLM.prepare_fused` (CUDA) or below
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if (
            fused.fused_on(x)
            and qkv is not None
            and tuple(m.weight.data_ptr() for m in mods) == qkv[1]
            and cos.shape[-1] * 2 == D
        ):
            out = F.linear(x, qkv[0])
            q = fused.rope(out[:, : H * D].view(n, H, D), cos, sin, interleaved=False)
            k = fused.rope(out[:, H * D : (H + G) * D].view(n, G, D), cos, sin, False)
            return q, k, out[:, (H + G) * D :].view(n, -1, D)
        if x.device.type != "cpu":
            q = rope(self.q_proj(x).view(n, H, D), cos, sin)
            k = rope(self.k_proj(x).view(n, G, D), cos, sin)
            return q, k, self.v_proj(x).view(n, -1, D)
        self._qkv = fused_weight((self.q_proj, self.k_proj, self.v_proj), self._qkv)
        qkv = F.linear(x, self._qkv[0])
        qk = rope(qkv[:, : (H + G) * D].view(n, H + G, D), cos, sin)
        # v: this rank's KV heads under tensor parallelism
        return qk[:, :H], qk[:, H:], qkv[:, (H + G) * D :].view(n, -1, D)

    def _attend(
        self,
        q: torch.Tensor,
        step: Step,
        plan: StepPlan,
        view: torch.Tensor,
        topk: torch.Tensor,
        physical: torch.Tensor,
        fmt: GqaRowFormat,
        cfg: GqaIndexerConfig,
    ) -> torch.Tensor:
        """Sparse attention. A decode step (one token per request, dense or sparse alike),
        and on CUDA any step, gathers each token's rows in one call (`sparse_gqa_decode`: the
        Triton kernel). Otherwise (prefill chunks, mixed steps) on the CPU `_attend_cpu`: dense
        causal tokens in one fused kernel, each other token over its own rows in place (a
        token costs its top-k rows, not its whole prefix). Elsewhere (or without numba)
        each request reads the union of its tokens' rows once, in position order (so the
        result does not depend on where rows sit), and masks each token to its own
        selection; all requests in one batched pass (`selected_gqa_varlen_reference`): far
        less copying than one gather per token and no loop over requests."""
        if plan.decode or sparse_gqa_kernel_takes(q, view, fmt):
            # (a multi-token step where the kernel takes the shapes, on CUDA by default: each
            # token over its own rows, one launch a layer instead of the batched path's
            # hundreds of ops, which bound a GPU prefill by the host; a padding token's rows
            # are all -1, so it gets 0. Shapes the kernel declines keep the batched path: its
            # per-token reference would gather each token's rows apart.)
            out, _ = sparse_gqa_decode(q, view, physical, self.scale, fmt, need_lse=False)
            return out
        if q.device.type == "cpu":
            out = self._attend_cpu(q, step, plan, view, physical, fmt, cfg)
            if out is not None:
                return out
        tokens = plan.tokens
        assert tokens is not None and plan.lens is not None
        n_req, longest = tokens.shape[0], max(plan.longest, 1)
        dev = q.device
        valid = step.req_index >= 0
        req = step.req_index.clamp_min(0)
        chosen = (topk >= 0) & valid[:, None]
        # Per request: which positions any of its tokens chose, and their physical rows.
        flat = (req[:, None] * longest + topk.long().clamp_min(0))[chosen]
        picked = torch.zeros(n_req * longest, dtype=torch.bool, device=dev)
        picked[flat] = True
        picked = picked.view(n_req, longest)
        slot = torch.cumsum(picked, 1) - 1  # column of each picked position in the union
        width = int(picked.sum(1).max()) if n_req else 0
        col = slot.view(-1)[flat]
        rows = torch.full((n_req, width), -1, dtype=torch.long, device=dev)
        rows.view(-1)[req[:, None].expand_as(topk)[chosen] * width + col] = physical[
            chosen
        ].long()  # every token of a request maps a position to the same row
        # selected[r, i, c]: the request's i-th token attends to union column c.
        rank = torch.zeros(q.shape[0], dtype=torch.long, device=dev)
        live = tokens >= 0
        rank[tokens[live]] = torch.nonzero(live)[:, 1]
        t_max = tokens.shape[1]
        selected = torch.zeros(n_req * t_max * width, dtype=torch.bool, device=dev)
        tok_of = (req * t_max + rank)[:, None].expand_as(topk)[chosen]
        selected[tok_of * width + col] = True
        safe = tokens.clamp_min(0)
        o = selected_gqa_varlen_reference(
            q[safe], view, rows, selected.view(n_req, t_max, width), self.scale, fmt
        )
        out = torch.zeros_like(q)  # padding tokens (no request) stay 0
        out[tokens[live]] = o[live]
        return out

    def _select(
        self,
        q: torch.Tensor,
        step: Step,
        plan: StepPlan,
        pages: torch.Tensor,
        table: torch.Tensor,
        fmt: GqaIndexerFormat,
        cfg: GqaIndexerConfig,
        dims: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logical top-k ``int32 [N, width]``, ``width = min(top_k, longest request)``."""
        longest = plan.longest
        width = longest if cfg.top_k is None else min(cfg.top_k, longest)
        if plan.decode and (plan.static or len(plan.lens or ()) > 1):
            # One batched scoring for all requests of a decode step (no host read).
            rows = plan.decode_rows
            assert rows is not None
            n_req = rows.shape[0]
            # static: row r is request r's token (rows is the identity), no gather
            qd, pos = (q, step.positions) if plan.static else (q[rows], step.positions[rows])
            chosen = gqa_indexer_topk_decode(
                qd, pos, pages, table[:n_req], step.seq_lens[:n_req],
                longest, fmt, cfg, self.scale, width, dims,
            )  # fmt: skip
            if plan.static:  # padding rows (no request): the swap-in maps them to no row
                return chosen
            out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
            out[rows] = chosen
            return out
        assert plan.lens is not None
        if plan.decode:  # batch-1 decode: the request's one token
            rows = plan.decode_rows
            assert rows is not None
            alone = q.shape[0] == 1  # no padding rows: row 0 is the token
            q1, pos1 = (q, step.positions) if alone else (q[rows], step.positions[rows])
            length = plan.lens[0]
            masks = None
            if cfg.top_k is not None and length > cfg.top_k:  # scored: masks once per step
                masks = plan.memo.get("select")
                if masks is None:
                    cpu = q.device.type == "cpu"
                    masks = selection_masks(pos1, length, q.shape[1], cfg, check=cpu)
                    plan.memo["select"] = masks
            chosen = gqa_indexer_topk(
                q1, pos1, pages, table[0], length, fmt, cfg, self.scale, width, dims, masks
            )
            if alone:
                return chosen
            out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
            out[rows] = chosen
            return out
        if gqa_indexer_kernel_takes(q, pages, table, fmt, cfg):
            # A multi-token step where the decode kernels take the shapes (on CUDA): every
            # token is a row of them (its request's table row and length, its own position):
            # the prefill's rule, since a token before position top_k has at most top_k
            # candidates and keeps them all. Blocks of tokens whose fp32 scratch (logits of
            # every head, masses) stays under PREFILL_SCRATCH_BYTES.
            # (each token's table row and length, the same for every layer: once a step; a
            # padding token has length 0, so it selects nothing)
            memo = plan.memo.get("token_rows")
            if memo is None or memo[0] is not table:
                req = step.req_index.clamp_min(0)
                lens = torch.where(step.req_index >= 0, step.seq_lens[req], 0)
                memo = (table, table[req], lens)
                plan.memo["token_rows"] = memo
            _, tables, lens = memo
            rows = max(1, PREFILL_SCRATCH_BYTES // (4 * (q.shape[1] + 1) * max(longest, 1)))
            blocks = [
                gqa_indexer_topk_decode(
                    q[lo : lo + rows], step.positions[lo : lo + rows], pages,
                    tables[lo : lo + rows], lens[lo : lo + rows], longest, fmt, cfg,
                    self.scale, width, dims,
                )
                for lo in range(0, q.shape[0], rows)
            ]  # fmt: skip
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return gqa_indexer_topk_prefill(
            q, step.positions, step.req_index, pages, table, plan.lens, fmt, cfg, self.scale,
            width, dims,
        )  # fmt: skip


#: Most bytes of indexer scratch one launch pair of a multi-token CUDA step allocates.
PREFILL_SCRATCH_BYTES = 1 << 28
