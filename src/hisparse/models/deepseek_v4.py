"""DeepSeek-V4 in plain PyTorch over packed batches and per-request caches (`v4_cache`).

Every layer attends one shared K=V head from all query heads over its sliding window; a
compressed sparse (CSA) layer adds the entries its lightning indexer picks among the 4-token
entries of its learned compressor, a heavily compressed (HCA) layer every 128-token entry before
the query; one softmax with a per-head sink covers window and entries
(`v4_attention_reference`). The residual is ``hc_mult`` hyper-connection streams; the MoE routes
its first layers by a hash of the token id. Names are the release's, so checkpoints load 1:1;
the fp32 forward equals transformers' ``DeepseekV4ForCausalLM`` up to summation order, in one
pass, in chunks (a chunk may end inside a compression window: the window closes in the step
that brings its last token) and token by token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.v4_attention_reference import v4_attention_reference
from hisparse.models.kv_access import ForwardStep
from hisparse.models.layers import embedding
from hisparse.models.v4_cache import DenseV4Cache, SlotState, V4Cache, state_ring
from hisparse.models.v4_config import CSA, SLIDING, V4Config
from hisparse.models.v4_layers import (
    V4MoE,
    V4RMSNorm,
    V4Rotary,
    hc_head,
    hc_merge,
    hc_weights,
    rope_tail,
    unweighted_rms_norm,
)

#: values the indexer's scoring may hold at once (`Attention._select` slices queries to it)
SCORE_BUDGET = 1 << 26


@dataclass
class StepIndex:
    """Where each request of a packed step sits: its first token's index in the batch and
    the position of that token (what a compressor needs to find a window's source rows)."""

    first_token: torch.Tensor  # [R]
    start_pos: torch.Tensor  # [R]

    @classmethod
    def of(cls, step: ForwardStep) -> StepIndex:
        rows = step.seq_lens.shape[0]
        req = step.req_index
        counts = torch.zeros(rows, dtype=torch.int64, device=req.device)
        counts.scatter_add_(0, req.clamp(min=0), (req >= 0).long())
        first = torch.cumsum(counts, 0) - counts
        return cls(first_token=first, start_pos=step.seq_lens - counts)


class Compressor(nn.Module):
    """Folds each closed window of ``rate`` tokens into one entry: a per-channel softmax over
    the window's gates (plus a learned bias per slot, ``ape``) weighs the projected rows, then
    an RMS norm and RoPE at the window's first position. ``overlap`` (CSA): every token
    projects two series; an entry mixes the previous window's first series with its own
    window's second."""

    def __init__(self, config: V4Config, width: int, rate: int, overlap: bool) -> None:
        super().__init__()
        series = width * (2 if overlap else 1)
        self.wkv = nn.Linear(config.hidden_size, series, bias=False)
        self.wgate = nn.Linear(config.hidden_size, series, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, series, dtype=torch.float32))
        self.norm = V4RMSNorm(width, config.rms_norm_eps)
        self.width, self.rate, self.overlap = width, rate, overlap

    def forward(
        self,
        x: torch.Tensor,
        step: ForwardStep,
        where: StepIndex,
        cache: V4Cache,
        layer: int,
        name: str,
        ring: int,
        rotary: V4Rotary,
    ) -> None:
        """Write the entries of the windows this step closes, then the carried state."""
        rate, width = self.rate, self.width
        pos, req = step.positions, step.req_index
        kv = self.wkv(x)
        gate = self.wgate(x)  # the slot bias joins when a window closes (fp32, as transformers)
        closing = (((pos + 1) % rate) == 0) & (req >= 0)
        # A fixed-shape step (CUDA graphs) reads nothing back: every token computes the entry
        # of the window it would close and only the closing ones are kept (others: pos -1).
        everyone = torch.arange(x.shape[0], device=x.device)
        ends = everyone if step.static else closing.nonzero().squeeze(1)
        if ends.numel():
            w = (pos[ends] + 1) // rate - 1
            r = req[ends]
            span = 2 * rate if self.overlap else rate
            first = w * rate - (rate if self.overlap else 0)
            src = first[:, None] + torch.arange(span, device=x.device)[None, :]  # [M, span]
            start = where.start_pos[r][:, None]
            from_step = (src >= start).unsqueeze(-1)
            tok = (where.first_token[r][:, None] + src - start).clamp(0, x.shape[0] - 1)
            ring_pos = torch.where(src >= 0, src % ring, -1)
            kv_src = torch.where(
                from_step, kv[tok], cache.read(layer, f"state.{name}.kv", r[:, None], ring_pos)
            )
            gate_src = torch.where(
                from_step, gate[tok], cache.read(layer, f"state.{name}.gate", r[:, None], ring_pos)
            )
            gate_src = (gate_src + self.ape[src % rate]).masked_fill(
                (src < 0).unsqueeze(-1), float("-inf")
            )
            if self.overlap:  # slots of the previous window: series a; own window: series b
                kv_src = torch.cat((kv_src[:, :rate, :width], kv_src[:, rate:, width:]), dim=1)
                gate_src = torch.cat(
                    (gate_src[:, :rate, :width], gate_src[:, rate:, width:]), dim=1
                )
            weights = gate_src.softmax(dim=1, dtype=torch.float32).to(kv_src.dtype)
            entry = self.norm((kv_src * weights).sum(dim=1))
            cos, sin = rotary(w * rate, entry.dtype)
            w = torch.where(closing[ends], w, -1)
            cache.write(layer, f"entries.{name}", r, w, rope_tail(entry, cos, sin))
        # Carry the newest `ring` positions of each request into the next step (a decode step:
        # all of its tokens; padding goes to the spare slot).
        newest = (pos >= step.seq_lens[req.clamp(min=0)] - ring) & (req >= 0)
        keep = everyone if step.static else newest.nonzero().squeeze(1)
        cache.write(layer, f"state.{name}.kv", req[keep], pos[keep] % ring, kv[keep])
        cache.write(layer, f"state.{name}.gate", req[keep], pos[keep] % ring, gate[keep])


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor over the same windows at
    ``index_head_dim``, scored against the query by ``Σ_h w_h · ReLU(q_h · k)``."""

    def __init__(self, config: V4Config, rate: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(config, self.head_dim, rate, overlap=True)

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        keys: torch.Tensor,
        ready: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Entry indices ``[N, min(topk, E)]`` of each query (``-1``: none) over its
        request's entry keys ``keys [N, E, Di]``, of which the first ``ready [N]`` may be read."""
        n = x.shape[0]
        q = rope_tail(self.wq_b(q_resid).view(n, self.n_heads, self.head_dim), cos, sin)
        scores = torch.einsum("nhd,ned->nhe", q.float(), keys.float())
        scores = F.relu(scores) * self.head_dim**-0.5
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        scores = (scores * w.unsqueeze(-1)).sum(dim=1)  # [N, E]
        entry = torch.arange(keys.shape[1], device=x.device)
        future = entry[None, :] >= ready[:, None]
        top = scores.masked_fill(future, float("-inf")).topk(min(self.topk, keys.shape[1]), dim=-1)
        return torch.where(top.indices >= ready[:, None], -1, top.indices)


class Attention(nn.Module):
    """Shared-KV multi-query attention with a sink, over window rows and compressed entries;
    grouped low-rank output projection."""

    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        h, d, heads = config.hidden_size, config.head_dim, config.num_attention_heads
        self.layer, self.config = layer, config
        self.kind = config.layer_types[layer]
        self.n_heads, self.head_dim = heads, d
        self.groups = config.o_groups
        self.wq_a = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, heads * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = V4RMSNorm(d, config.rms_norm_eps)
        self.wo_a = nn.Linear(
            heads * d // self.groups, self.groups * config.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.rate = config.compress_rate(layer)
        self.compressor = (
            Compressor(config, d, self.rate, overlap=self.kind == CSA) if self.rate else None
        )
        self.indexer = Indexer(config, self.rate) if self.kind == CSA else None

    def _entries(self, name: str, cache: V4Cache, req: torch.Tensor, count: int) -> torch.Tensor:
        pos = torch.arange(count, device=req.device)[None, :].expand(req.shape[0], count)
        return cache.read(self.layer, f"entries.{name}", req[:, None], pos)

    def _select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        req: torch.Tensor,
        ready: torch.Tensor,
        count: int,
        cache: V4Cache,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The indexer's choice for every query, a slice of queries at a time so that the
        keys gathered per query and the per-head scores (``queries × count × heads``) stay
        within `SCORE_BUDGET` values whatever the context."""
        assert self.indexer is not None
        ix = self.indexer
        rows = max(1, SCORE_BUDGET // (count * max(ix.n_heads, ix.head_dim)))
        cos, sin = rope["compress"]
        parts = []
        for lo in range(0, x.shape[0], rows):
            sl = slice(lo, lo + rows)
            keys = self._entries("indexer", cache, req[sl], count)
            parts.append(ix.select(x[sl], q_resid[sl], keys, ready[sl], cos[sl], sin[sl]))
        return torch.cat(parts)

    def forward(
        self,
        x: torch.Tensor,
        step: ForwardStep,
        where: StepIndex,
        cache: V4Cache,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        rotary: V4Rotary,
    ) -> torch.Tensor:
        n, cfg = x.shape[0], self.config
        pos, req = step.positions, step.req_index
        cos, sin = rope["main" if self.kind == SLIDING else "compress"]
        q_resid = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(
            self.wq_b(q_resid).view(n, self.n_heads, self.head_dim), cfg.rms_norm_eps
        )
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)
        cache.write(self.layer, "window", req, pos, kv)
        arange_w = torch.arange(cfg.sliding_window, device=x.device)
        win = pos[:, None] - cfg.sliding_window + 1 + arange_w
        win = win.masked_fill(win < 0, -1)
        entries: torch.Tensor | None = None  # entry indices per query (-1: none)
        if self.compressor is not None:
            ring = state_ring(cfg, self.layer)
            self.compressor(x, step, where, cache, self.layer, "compressor", ring, rotary)
            max_len = step.max_len if step.max_len is not None else int(step.seq_lens.max())
            count = max_len // self.rate
            ready = (pos + 1) // self.rate
            if self.indexer is not None:
                self.indexer.compressor(x, step, where, cache, self.layer, "indexer", ring, rotary)
                if count:
                    entries = self._select(x, q_resid, req, ready, count, cache, rope)
            elif count:
                entry = torch.arange(count, device=x.device)[None, :].expand(n, count)
                entries = entry.masked_fill(entry >= ready[:, None], -1)
        scale = self.head_dim**-0.5
        attend = getattr(cache, "attend", None)  # the engine's pools: rows read in place
        if attend is not None:
            out = attend(self.layer, q, req, win, entries, self.attn_sink, scale)
        else:
            rows = cache.read(self.layer, "window", req[:, None], win)
            valid = win >= 0
            if entries is not None:
                got = cache.read(self.layer, "entries.compressor", req[:, None], entries)
                rows, valid = torch.cat((rows, got), dim=1), torch.cat((valid, entries >= 0), 1)
            out = v4_attention_reference(q, rows, valid, self.attn_sink, scale)
        out = rope_tail(out, cos, -sin)  # K = V carried RoPE into the values: undo it
        grouped = out.reshape(n, self.groups, -1).transpose(0, 1)  # [g, N, H*D/g]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        mid = torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1)
        return self.wo_b(mid)


class Block(nn.Module):
    """One decoder layer: attention and MoE, each between two hyper-connection mixes."""

    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.attn_norm = V4RMSNorm(h, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = V4RMSNorm(h, config.rms_norm_eps)
        self.ffn = V4MoE(config, layer)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * h)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def hc(self, part: str, streams: torch.Tensor, config: V4Config) -> tuple[torch.Tensor, ...]:
        fn, base, scale = (getattr(self, f"hc_{part}_{k}") for k in ("fn", "base", "scale"))
        return hc_weights(streams, fn, base, scale, config)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 causal LM; state-dict keys are the release's tensor names."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        n, h = config.hc_mult, config.hidden_size
        self.embed = embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = V4RMSNorm(h, config.rms_norm_eps)
        self.head = nn.Linear(h, config.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.rotary_main = V4Rotary(config.rope_main, config.qk_rope_head_dim)
        self.rotary_compress = V4Rotary(config.rope_compress, config.qk_rope_head_dim)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, step: ForwardStep, cache: V4Cache) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` of a packed batch ``input_ids [N]``."""
        cfg = self.config
        x = self.embed(input_ids)
        rope = {
            "main": self.rotary_main(step.positions, x.dtype),
            "compress": self.rotary_compress(step.positions, x.dtype),
        }
        where = StepIndex.of(step)
        # Every expert on every row only where a host read cannot happen (a CUDA graph being
        # captured): with V4's 256 experts (4-bit ones dequantized per call) the eager forms,
        # the fixed-shape step run eagerly included, read the chosen experts back instead.
        sync_free = step.static and x.is_cuda and torch.cuda.is_current_stream_capturing()
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for block in self.layers:
            assert isinstance(block, Block)
            post, comb, collapsed = block.hc("attn", streams, cfg)
            out = block.attn(
                block.attn_norm(collapsed), step, where, cache, rope, self.rotary_compress
            )
            streams = hc_merge(streams, out, post, comb)
            post, comb, collapsed = block.hc("ffn", streams, cfg)
            mlp = block.ffn(block.ffn_norm(collapsed), input_ids, sync_free=sync_free)
            streams = hc_merge(streams, mlp, post, comb)
        collapsed = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg)
        return self.norm(collapsed)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def new_dense_cache(self, *, max_reqs: int, max_len: int) -> DenseV4Cache:
        """A `DenseV4Cache` in this model's dtype, on its device."""
        w = self.head.weight
        return DenseV4Cache(
            self.config, max_reqs=max_reqs, max_len=max_len, dtype=w.dtype, device=w.device
        )

    def new_slot_state(
        self, slots: int, device: torch.device, window_ring: bool = False
    ) -> SlotState:
        """The compressors' carried state of ``slots`` engine request slots (`V4StepCache`);
        ``window_ring``: the window rows' rings too (HiSparse placement)."""
        return SlotState(self.config, slots, self.head.weight.dtype, device, window_ring)

    @torch.no_grad()
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Logits ``[len_i, vocab]`` of each prompt, all prompts in one packed step."""
        cache = self.new_dense_cache(max_reqs=len(prompts), max_len=max(len(p) for p in prompts))
        step = cache.begin_step(range(len(prompts)), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=self.head.weight.device)
        return list(self.logits(self(ids, step, cache)).split([len(p) for p in prompts]))
