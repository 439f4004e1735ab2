"""DeepSeek-V3.2 and GLM-5 (DSA) in plain PyTorch, running through paged KV caches.

The network is the transformers reference (same module and weight names, so checkpoints load
1:1), but attention always runs in the absorbed ("MQA") form over the paged cache: the layer
packs its 576-dim ``[latent ‖ rope]`` rows in the cache's row format, the lightning indexer
picks each token's top-k earlier positions, the cache turns them into physical rows, and
`sparse_mla_decode_reference` attends over exactly those rows. Prefill and decode share this
path, so an all-GPU cache, HiSparse's offloaded cache and the dense test cache differ only in
where the rows sit. Exact in fp32 against transformers (up to summation order).

GLM-5 differs by configuration only: interleaved RoPE in the indexer, and IndexShare layers
(no indexer; they reuse the previous full layer's logical top-k).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention import sparse_mla_decode
from hisparse.attention.dispatch import indexer_topk_paged
from hisparse.kv.row_formats import IndexerCacheFormat, MlaFormat, write_indexer_keys
from hisparse.models import fused
from hisparse.models.dsa_config import DsaConfig
from hisparse.models.fp8_moe import Fp8Experts
from hisparse.models.kv_access import DenseDsaCache, DsaKVCache, ForwardStep
from hisparse.models.layers import (
    MLP,
    CachedRotary,
    RMSNorm,
    StackedLinear,
    embedding,
    rope_half_split,
    rope_interleaved,
    stackable,
)

INDEXER_MODES = ("exact", "fp8")


# ---------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------
class Rotary(CachedRotary):
    """cos/sin of the rotary slice at given positions (YaRN-scaled when configured)."""

    def __init__(self, config: DsaConfig) -> None:
        super().__init__()
        # A loader's meta skeleton replaces this module: compute it on the CPU there (meta
        # aranges import torch._dynamo, tens of MB of a loading rank's memory), else as asked.
        meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            inv_freq, factor = config.rope.inv_freq_and_factor(config.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.factor = factor

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[N, R / 2]`` (one angle per rotated pair)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


class Router(nn.Module):
    """Sigmoid scores, bias-corrected grouped top-k (DeepSeek ``noaux_tc``); weights in fp32."""

    def __init__(self, config: DsaConfig) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k] fp32, expert ids [N, k])``."""
        n, e = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        # Groups ranked by the sum of their two best bias-corrected scores; keep topk_group.
        grouped = choice.view(n, self.n_group, e // self.n_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep_groups = group_score.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    """Routed experts (one `MLP` each, original checkpoint layout) plus shared experts.

    Two formulations of the routed sum, same terms in the same (ascending expert) order:
    ``sync_free=False`` runs each chosen expert on its tokens only (reads the chosen ids back
    to the host: one sync per layer; the CPU path checked against transformers);
    ``sync_free=True`` runs every expert on every row and keeps a row's term only where the
    router chose that expert (no host read, fixed shapes: CUDA-graph capturable). The dense
    form costs ``n_routed_experts / num_experts_per_tok`` times the expert FLOPs and reads
    every expert's weights each step: negligible for the few-expert presets, not for a
    256-expert model (a grouped-GEMM kernel would be the fix there). A row's value may differ
    from the per-expert form in float bits only through the matmul's row count (``M``).

    After `stack_experts`, on CUDA (`fused.fused_on`), the sync-free form runs all experts as
    two batched matmuls over stacked weights (the experts' parameters become views of them)
    between a routing and a combine kernel, instead of a dozen kernels per expert; the combine
    adds the terms in the loop's order and rounding, so again only the matmuls' shapes differ.
    """

    def __init__(self, config: DsaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(h, i) for _ in range(config.n_routed_experts))
        self.shared_experts = MLP(h, i * config.n_shared_experts)
        #: the routed experts as stacked fp8 weights (`Fp8Experts`, set by the loader for an
        #: fp8 checkpoint; ``experts`` is then empty)
        self.fp8_experts: Fp8Experts | None = None
        self.w_gate_up: torch.Tensor | None = None  # [E (+1), 2I, H] after stack_experts
        self.w_down: torch.Tensor | None = None  # [E (+1), H, I]
        self.shared_in_stack = False  # the shared expert is the stacks' last entry
        self._stack_ptrs: tuple[int, ...] = ()
        #: expert parallelism (`hisparse.parallel.expert.ExpertParallel`): this rank's experts
        #: over every data-parallel rank's tokens
        self.ep: Any = None

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Move the routed experts' weights into two stacked tensors (each expert's parameters
        become views of them; one expert's copy at a time is extra while it runs) for the
        batched sync-free form. The shared expert joins them as the last entry where it has
        the routed experts' shape (one shared expert: DeepSeek-V3.2, GLM-5), so the two
        batched matmuls compute it too (three launches fewer); otherwise its gate and up
        projections are stacked on their own. Call again after replacing expert weights.
        fp8 experts are stacked already (`Fp8Experts`)."""
        experts = [e for e in self.experts if isinstance(e, MLP)]
        if not experts or type(experts[0].gate_proj) is not nn.Linear:
            return
        if len(experts) != len(self.experts):
            return  # split over expert-parallel ranks: their forward loops over its experts
        w0 = experts[0].gate_proj.weight
        inter, hidden = w0.shape
        sw = self.shared_experts.gate_proj.weight
        self.shared_in_stack = (
            sw.shape == w0.shape and sw.dtype == w0.dtype and sw.device == w0.device
        )
        if self.shared_in_stack:
            self.shared_experts.gate_up = None
            experts.append(self.shared_experts)
        else:
            self.shared_experts.stack_gate_up()
        gate_up = torch.empty(len(experts), 2 * inter, hidden, dtype=w0.dtype, device=w0.device)
        down = torch.empty(len(experts), hidden, inter, dtype=w0.dtype, device=w0.device)
        for i, e in enumerate(experts):
            gate_up[i, :inter].copy_(e.gate_proj.weight)
            gate_up[i, inter:].copy_(e.up_proj.weight)
            down[i].copy_(e.down_proj.weight)
            e.gate_proj.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self.w_gate_up, self.w_down = gate_up, down
        self._stack_ptrs = self._watched_ptrs()

    def _watched_ptrs(self) -> tuple[int, ...]:
        first, last = self.experts[0], self.experts[-1]
        assert isinstance(first, MLP) and isinstance(last, MLP)
        watched = [first.gate_proj, first.down_proj, last.up_proj, last.down_proj]
        if self.shared_in_stack:
            watched += [self.shared_experts.gate_proj, self.shared_experts.down_proj]
        return tuple(m.weight.data_ptr() for m in watched)

    def _stacked(self) -> bool:
        """Whether the stacked weights still back the experts (the first and last expert's
        weights where stacking put them). ``.to()`` or a reload copies the parameters apart:
        the stacks are then dropped (freeing them) and the loop runs."""
        if self.w_gate_up is None:
            return False
        if self._watched_ptrs() == self._stack_ptrs:
            return True
        self.w_gate_up = self.w_down = None
        return False

    def _batched(self, x: torch.Tensor) -> torch.Tensor:
        assert self.w_gate_up is not None and self.w_down is not None
        e = len(self.experts)
        w, chosen = fused.route_dense(self.gate, x)  # [N, E]: weights (0: not chosen), mask
        gate_up = torch.matmul(x, self.w_gate_up.transpose(1, 2))  # [E (+1), N, 2I]
        h = fused.silu_mul(gate_up)
        y = torch.bmm(h, self.w_down.transpose(1, 2))  # [E (+1), N, H]
        shared = y[e] if self.shared_in_stack else self.shared_experts(x)
        return fused.moe_combine(y[:e], w, chosen, shared)

    def forward(self, x: torch.Tensor, *, sync_free: bool = False) -> torch.Tensor:
        if self.ep is not None:
            return self.ep.forward(self, x)
        if self.fp8_experts is not None:  # grouped GEMMs: sync-free on every path
            weights, ids = self.gate(x)
            return self.fp8_experts(x, weights, ids) + self.shared_experts(x)
        if sync_free and self._stacked() and fused.fused_on(x):
            return self._batched(x)
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        if sync_free:
            for e, expert in enumerate(self.experts):
                chosen = ids == e  # [N, k]: at most one True per row
                w = torch.where(chosen, weights, 0.0).sum(-1, keepdim=True)  # exact: one term
                y = (expert(x) * w).to(out.dtype)
                out = out + torch.where(chosen.any(-1, keepdim=True), y, 0.0)
            return out + self.shared_experts(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out + self.shared_experts(x)


# ---------------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------------
class Indexer(nn.Module):
    """Scores earlier tokens for each query token; keys live in their own paged cache."""

    def __init__(self, config: DsaConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleaved = config.indexer_rope_interleaved
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Kept in fp32 whatever the model dtype (transformers: _keep_in_fp32_modules).
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = (rope_interleaved if self.interleaved else rope_half_split)(
            x[..., : self.rope_dim], cos, sin
        )
        return torch.cat((rot, x[..., self.rope_dim :]), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: ForwardStep,
        pages_write: tuple[torch.Tensor, torch.Tensor],
        pages_read: tuple[torch.Tensor, torch.Tensor],
        fmt: IndexerCacheFormat,
        mode: str,
        k_proj: torch.Tensor | None = None,
        q_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's keys, then return logical top-k ``[N, index_topk]`` int32 (-1 pad).
        ``k_proj`` / ``q_proj``: ``wk(x)`` / ``wq_b(q_resid)`` when the caller computed them
        (`MLAttention`'s stacked projections)."""
        n = x.shape[0]
        q = (q_proj if q_proj is not None else self.wq_b(q_resid)).view(
            n, self.n_heads, self.head_dim
        )
        k = k_proj if k_proj is not None else self.wk(x)
        w = fused.indexer_head_weights(self.weights_proj, x, self.n_heads**-0.5)
        pages, slots = pages_write
        q_scale = None
        if mode == "fp8":
            q, q_scale = fused.indexer_fp8_query(
                q, cos, sin, self.rope_dim, self.interleaved, fmt.tile
            )
            fused.indexer_fp8_write_keys(
                k, cos, sin, self.rope_dim, self.interleaved, pages, fmt, slots, self.k_norm
            )
        else:
            if fmt.kind != "fp32":
                raise ValueError("the exact indexer mode needs fp32 indexer pages")
            k = self.k_norm(k)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            write_indexer_keys(pages, fmt, slots, k.float())
        read_pages, table = pages_read
        return indexer_topk_paged(
            q, q_scale, w, read_pages, fmt, table, step.req_index, step.positions,
            step.seq_lens, self.topk, self.softmax_scale, max_len=step.max_len,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Attention, layers, model
# ---------------------------------------------------------------------------------------------
class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed form, sparse over the indexer's top-k."""

    def __init__(self, config: DsaConfig, layer: int, indexer: bool | None = None) -> None:
        """``indexer``: whether the layer owns one (default: the config's schedule; a
        multi-token-prediction layer past the config's layers says)."""
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.c = config.kv_lora_rank
        self.scale = config.softmax_scale
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(
            config.q_lora_rank, self.n_heads * (self.nope + self.rope_dim), bias=False
        )
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.c + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.c, 1e-6)
        self.kv_b_proj = nn.Linear(self.c, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, config.hidden_size, bias=bias)
        own = config.indexer_full[layer] if indexer is None else indexer
        self.indexer = Indexer(config) if own else None
        self.a_proj: StackedLinear | None = None
        self.b_proj: StackedLinear | None = None

    @torch.no_grad()
    def stack_projections(self) -> None:
        """The projections of the layer's input (``q_a_proj``, ``kv_a_proj_with_mqa`` and the
        indexer's ``wk``), and those of the normed query latent (``q_b_proj`` and the
        indexer's ``wq_b``), as one matmul each on CUDA (`StackedLinear`), where they can be
        joined."""
        mods = [self.q_a_proj, self.kv_a_proj_with_mqa]
        if self.indexer is not None:
            mods.append(self.indexer.wk)
        if stackable(mods):
            self.a_proj = StackedLinear(mods)
        if self.indexer is not None and stackable([self.q_b_proj, self.indexer.wq_b]):
            self.b_proj = StackedLinear([self.q_b_proj, self.indexer.wq_b])

    def _project_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q_a_proj(x), kv_a_proj_with_mqa(x), indexer.wk(x) or None)``."""
        a = self.a_proj
        if a is not None and not a.valid():
            a = self.a_proj = None  # copied apart since (``.to()``, a reload): drop it
        if a is not None and fused.fused_on(x):
            q_a, kv_a, *k_idx = a(x).split(a.sizes, dim=-1)
            return q_a, kv_a, (k_idx[0] if k_idx else None)
        return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None

    def _project_b(self, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(q_b_proj(q_resid), indexer.wq_b(q_resid) or None)``."""
        b = self.b_proj
        if b is not None and not b.valid():
            b = self.b_proj = None  # copied apart since: drop it
        if b is not None and fused.fused_on(q_resid):
            q, q_idx = b(q_resid).split(b.sizes, dim=-1)
            return q, q_idx
        return self.q_b_proj(q_resid), None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: ForwardStep,
        cache: DsaKVCache,
        shared_topk: torch.Tensor | None,
        indexer_mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [N, hidden], logical top-k [N, K])`` (the top-k feeds IndexShare layers)."""
        n = x.shape[0]
        q_a, kv_a, k_idx = self._project_a(x)
        _, q_resid = fused.add_rms_norm(self.q_a_layernorm, q_a)
        q, q_idx = self._project_b(q_resid)
        q = q.view(n, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = fused.rope(q_pe, cos, sin, interleaved=True)

        # 1. this step's rows (normed latent, rotated rope part) into the paged cache.
        kv = cache.attention(self.layer)
        view, slots = kv.write_target()
        fused.write_mla_rows(kv_a, self.kv_a_layernorm, cos, sin, view, slots, cache.row_format)
        kv.finish_kv_update()

        # 2. logical top-k: own indexer, or the index-group leader's selection.
        if self.indexer is not None:
            idx_cache = cache.indexer(self.layer)
            topk = self.indexer(
                x,
                q_resid,
                cos,
                sin,
                step,
                idx_cache.write_target(),
                idx_cache.read_source(),
                cache.indexer_format,
                indexer_mode,
                k_idx,
                q_idx,
            )
        elif shared_topk is not None:
            topk = shared_topk
        else:
            raise RuntimeError(f"layer {self.layer} shares top-k but no full layer precedes it")

        # 3./4. physical rows, then sparse attention in latent space.
        physical = kv.swap_in(topk)
        w_kv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.c)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope :]
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        out_latent, _ = sparse_mla_decode(
            q_latent, q_pe, view, physical, self.scale, cache.row_format
        )
        # per head: out_latent [h, n, c] @ w_uv.T, written straight into token-major rows
        # (an einsum's head-major result cost a copy before o_proj)
        out = torch.empty(n, self.n_heads, self.v_dim, dtype=x.dtype, device=x.device)
        lat = out_latent.to(x.dtype).transpose(0, 1)
        torch.bmm(lat, w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return self.o_proj(out.view(n, self.n_heads * self.v_dim)), topk


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DsaConfig,
        layer: int,
        *,
        sparse: bool | None = None,
        indexer: bool | None = None,
    ) -> None:
        """``sparse`` (a MoE) and ``indexer``: default the config's schedules (a layer past
        them, the multi-token-prediction layer, says)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer, indexer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.mlp_layer_types[layer] == "sparse" if sparse is None else sparse
        self.mlp: nn.Module = (
            MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)
        )


class DsaBackbone(nn.Module):
    def __init__(self, config: DsaConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DsaForCausalLM(nn.Module):
    """DeepSeek-V3.2 / GLM-5 causal LM. State-dict keys are the Hugging Face names.

    ``indexer_mode``: ``"exact"`` (fp32 scores, transformers' reference; fp32 key pages) or
    ``"fp8"`` (Hadamard + e4m3 keys/queries, DeepSeek's inference path; 132 B key pages).
    """

    def __init__(self, config: DsaConfig, indexer_mode: str = "exact") -> None:
        super().__init__()
        if indexer_mode not in INDEXER_MODES:
            raise ValueError(f"indexer_mode {indexer_mode!r}: expected one of {INDEXER_MODES}")
        self.config = config
        self.indexer_mode = indexer_mode
        self.model = DsaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        #: the checkpoint's multi-token-prediction layers (`hisparse.models.mtp`), loaded and
        #: kept for speculative decoding; not run by `forward`
        self.mtp = nn.ModuleList()

    @property
    def indexer_format(self) -> IndexerCacheFormat:
        """The indexer key pages this model's indexer mode reads and writes."""
        return IndexerCacheFormat.for_mode(self.indexer_mode, self.config.index_head_dim)

    def prepare_fused(self) -> DsaForCausalLM:
        """The fused forms' one-time state (call once the weights sit where they run, on
        CUDA): `MoE.stack_experts` on every MoE layer (its shared expert included),
        `MLP.stack_gate_up` on the dense MLPs, `MLAttention.stack_projections` on every layer,
        and the rotary table of every position; fp8 layers choose their GEMM kernel."""
        from hisparse.models import fp8_linear

        if any(isinstance(m, fp8_linear.Fp8Linear | Fp8Experts) for m in self.modules()):
            fp8_linear.prepare(self.lm_head.weight.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.stack_experts()  # the shared expert's gate and up too
            elif isinstance(module, DecoderLayer) and isinstance(module.mlp, MLP):
                module.mlp.stack_gate_up()
            elif isinstance(module, MLAttention):
                module.stack_projections()
        w = self.lm_head.weight
        self.rotary.build_table(self.config.max_position_embeddings, w.dtype, w.device)
        return self

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, step: ForwardStep, cache: DsaKVCache
    ) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` of a packed batch ``input_ids [N]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(step.positions, x.dtype, step.max_len)
        topk: torch.Tensor | None = None
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        # Each residual add is fused with the norm that follows it (the next layer's input
        # norm, or the final norm after the last layer).
        _, h = fused.add_rms_norm(layers[0].input_layernorm, x)
        for i, layer in enumerate(layers):
            attn, topk = layer.self_attn(h, cos, sin, step, cache, topk, self.indexer_mode)
            x, h = fused.add_rms_norm(layer.post_attention_layernorm, x, attn)
            moe = isinstance(layer.mlp, MoE)
            mlp = layer.mlp(h, sync_free=step.static) if moe else layer.mlp(h)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = fused.add_rms_norm(after, x, mlp)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def new_dense_cache(
        self,
        *,
        max_reqs: int,
        max_len: int,
        block_size: int = 64,
        row_format: MlaFormat = "fp32",
    ) -> DenseDsaCache:
        """A `DenseDsaCache` with this model's indexer format, on the model's device."""
        return DenseDsaCache(
            self.config,
            max_reqs=max_reqs,
            max_len=max_len,
            block_size=block_size,
            row_format=row_format,
            indexer_format=self.indexer_format,
            device=self.lm_head.weight.device,
        )

    @torch.no_grad()
    def prefill_logits(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        row_format: MlaFormat = "fp32",
        block_size: int = 16,
    ) -> list[torch.Tensor]:
        """Logits ``[len_i, vocab]`` of each prompt, all prompts in one packed step."""
        cache = self.new_dense_cache(
            max_reqs=len(prompts),
            max_len=max(len(p) for p in prompts),
            block_size=block_size,
            row_format=row_format,
        )
        step = cache.begin_step(range(len(prompts)), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=self.lm_head.weight.device)
        logits = self.logits(self(ids, step, cache))
        return list(logits.split([len(p) for p in prompts]))
