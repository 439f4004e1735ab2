"""Llama-architecture models (SmolLM2 and kin) in plain PyTorch, through paged GQA caches.

The network is transformers' ``LlamaForCausalLM`` (same module and weight names), but every
attention layer goes through the same cache protocol as the DSA model
(`hisparse.models.kv_access`):

1. pack this step's K and V of all KV heads as one row per token (`GqaRowFormat`) and write
   them at the physical slots of ``write_target()``, then ``finish_kv_update()``;
2. write the compact indexer keys into the layer's index pages and choose ONE logical top-k
   per query token (`gqa_indexer_topk`: training-free, shared by all heads of the layer);
3. ``swap_in(logical_topk)`` -> physical rows (HiSparse gathers misses from the host);
4. sparse GQA attention over those rows (`sparse_gqa_decode`: the Triton kernel on CUDA, in
   decode and, one row per token, in prefill; the reference otherwise; a CPU prefill runs
   `LlamaAttention._attend_cpu`).

The attention layer (these four steps) and what it reads from a step are in `llama_attention`;
the CPU forms of a layer (the batch-1 decode step, a prefill's attention) are in `llama_cpu`.

Prefill and decode share this path (packed variable-length batches), so the dense test cache,
the all-GPU placement and HiSparse differ only in where rows sit. With ``top_k=None`` or a
``top_k`` at least the context length, every earlier token is chosen and attention is dense.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.gqa_indexer_keys import rope_pair_dims
from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat
from hisparse.attention.sparse_gqa_reference import GqaRowFormat, gqa_dtype_name
from hisparse.models import fused
from hisparse.models.kv_access import (
    DenseBlockTables,
    IndexerLayerCache,
    SparseMlaLayerCache,
)
from hisparse.models.layers import (
    MLP,
    CachedRotary,
    RMSNorm,
    embedding,
    full_width_rope,
    fused_weight,
    stackable,
)
from hisparse.models.llama_attention import LlamaAttention, Step, StepPlan
from hisparse.models.llama_cpu import decode_one_cpu, decode_one_cpu_applies
from hisparse.models.llama_cpu_rows import decode_rows_cpu, decode_rows_cpu_applies


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture model (names as in transformers' ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    def row_format(self, dtype: torch.dtype | str) -> GqaRowFormat:
        """The KV row of one layer in ``dtype`` (SmolLM2: 768 B bf16, 1536 B fp32)."""
        return GqaRowFormat(self.num_key_value_heads, self.head_dim, gqa_dtype_name(dtype))


@runtime_checkable
class GqaKVCache(Protocol):
    """The model-level view of a GQA model's caches (like `DsaKVCache`)."""

    @property
    def row_format(self) -> GqaRowFormat: ...

    @property
    def indexer_format(self) -> GqaIndexerFormat: ...

    def attention(self, layer: int) -> SparseMlaLayerCache: ...

    def indexer(self, layer: int) -> IndexerLayerCache: ...


class DenseGqaCache(DenseBlockTables):
    """Every KV row and index page of every request in plain tensors (tests, CPU use)."""

    def __init__(
        self,
        config: LlamaConfig,
        indexer_format: GqaIndexerFormat,
        *,
        max_reqs: int,
        max_len: int,
        block_size: int = 16,
        row_format: GqaRowFormat | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(max_reqs=max_reqs, max_len=max_len, block_size=block_size, device=device)
        self._row_format = row_format or config.row_format("fp32")
        self._indexer_format = indexer_format
        page = indexer_format.page_bytes(block_size)
        shape = (self.num_blocks, block_size, self._row_format.row_bytes)
        self.kv = [
            torch.zeros(shape, dtype=torch.uint8, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]
        self.index_pages = {
            i: torch.zeros(self.num_blocks, page, dtype=torch.uint8, device=self.device)
            for i in range(config.num_hidden_layers)
        }

    @property
    def row_format(self) -> GqaRowFormat:
        return self._row_format

    @property
    def indexer_format(self) -> GqaIndexerFormat:
        return self._indexer_format


class Rotary(CachedRotary):
    """cos/sin of each position, computed as transformers does (fp32, then the model dtype)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d = config.head_dim
        # A loader's meta skeleton replaces this module: compute it on the CPU there (a meta
        # arange would import torch._dynamo), on the default device otherwise.
        meta = torch.get_default_device().type == "meta"
        dims = torch.arange(0, d, 2, dtype=torch.float, device="cpu" if meta else None)
        inv_freq = 1.0 / (config.rope_theta ** (dims / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[N, D / 2]``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)


class LlamaBackbone(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama causal LM; state-dict keys are the Hugging Face names (``lm_head`` tied or not).

    ``indexer`` (a `GqaIndexerConfig`) sets the top-k budget and scoring method; change it at
    any time with `set_indexer` (caches must then be built with the new `indexer_format`).
    """

    def __init__(self, config: LlamaConfig, indexer: GqaIndexerConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.indexer = indexer or GqaIndexerConfig()
        self.model = LlamaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        #: a batch-1 CPU decode step may take `llama_cpu.decode_one_cpu` (a tensor-parallel
        #: shard may not: that path calls no module, so no all-reduce hook runs)
        self.cpu_fast_path = True
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        #: gate and up projections of each layer as one weight (`fused_weight`; CPU decode).
        self._gate_up: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self._indexer_format: tuple[GqaIndexerConfig, GqaIndexerFormat] | None = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def indexer_format(self) -> GqaIndexerFormat:
        """The index pages this model's indexer method reads and writes."""
        known = self._indexer_format
        if known is not None and known[0] is self.indexer:
            return known[1]
        cfg = self.config
        fmt = GqaIndexerFormat.for_config(self.indexer, cfg.num_key_value_heads, cfg.head_dim)
        self._indexer_format = (self.indexer, fmt)
        return fmt

    def set_indexer(self, indexer: GqaIndexerConfig | None = None, **changes) -> LlamaForCausalLM:
        """Replace the indexer settings (``set_indexer(top_k=256)`` keeps the rest)."""
        self.indexer = replace(indexer or self.indexer, **changes)
        self.prepare_indexer()
        return self

    @torch.no_grad()
    def prepare_indexer(self) -> None:
        """Derive weight-dependent indexer state (``lowrank`` dims); call after loading weights."""
        if self.indexer.method != "lowrank":
            return
        cfg = self.config
        for layer in self.model.layers:
            attn = layer.self_attn
            assert isinstance(attn, LlamaAttention)
            attn.index_dims = rope_pair_dims(
                attn.q_proj.weight,
                attn.k_proj.weight,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                self.indexer.lowrank_pairs,
            ).to(self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, step: Step, cache: GqaKVCache) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` of a packed batch ``input_ids [N]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(step.positions, x.dtype, step.max_len)
        if x.device.type == "cpu" and not fused.fused_on(x):  # the same rotation, fewer ops
            cos, sin = full_width_rope(cos, sin)
        plan = StepPlan.of(step)
        fast = self.cpu_fast_path and decode_one_cpu_applies(x, plan)
        if fast and cache.row_format.torch_dtype == torch.float32:
            return decode_one_cpu(self, x, cos, sin, step, cache, plan)  # writes fp32 rows
        rows = self.cpu_fast_path and decode_rows_cpu_applies(x, step, plan)
        if rows and cache.row_format.torch_dtype == torch.float32:
            return decode_rows_cpu(self, x, cos, sin, step, cache, plan)  # a verify step
        layers = [layer for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]
        # Each residual add is fused with the norm that follows it (one kernel on CUDA; on
        # the CPU the add, then `rms_norm`).
        _, h = fused.add_rms_norm(layers[0].input_layernorm, x)
        for i, layer in enumerate(layers):
            attn = layer.self_attn(h, cos, sin, step, cache, self.indexer, plan)
            x, h = fused.add_rms_norm(layer.post_attention_layernorm, x, attn)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = fused.add_rms_norm(after, x, self._mlp(i, layer.mlp, h))
        return h

    @torch.no_grad()
    def prepare_fused(self) -> LlamaForCausalLM:
        """The fused forms' one-time state (call once the weights sit where they run, on
        CUDA): each layer's q, k, v and gate, up projections stacked into one weight apiece,
        and the rotary table of every position."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            attn = layer.self_attn
            mods = (attn.q_proj, attn.k_proj, attn.v_proj)
            if stackable(mods):
                attn._qkv = fused_weight(mods, None)
            if stackable((layer.mlp.gate_proj, layer.mlp.up_proj)):
                layer.mlp.stack_gate_up()
        w = self.lm_head.weight
        self.rotary.build_table(self.config.max_position_embeddings, w.dtype, w.device)
        return self

    def _mlp(self, i: int, mlp: MLP, h: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP; for one CPU row (decode) with the gate and up projections as
        one matmul (`fused_weight`, the same bits). Many rows (a prefill) keep two: the
        matmul costs the same, and ``silu`` and ``*`` over the halves of the fused output
        (strided) took several times as long as over two contiguous outputs."""
        if h.device.type != "cpu" or h.shape[0] != 1:
            return mlp(h)
        fused = fused_weight((mlp.gate_proj, mlp.up_proj), self._gate_up.get(i))
        self._gate_up[i] = fused
        gu = F.linear(h, fused[0])
        inter = gu.shape[1] // 2
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], mlp.down_proj.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def new_dense_cache(
        self,
        *,
        max_reqs: int,
        max_len: int,
        block_size: int = 16,
        kv_dtype: torch.dtype | str | None = None,
    ) -> DenseGqaCache:
        """A `DenseGqaCache` on the model's device; rows in ``kv_dtype`` (default: model dtype)."""
        return DenseGqaCache(
            self.config,
            self.indexer_format,
            max_reqs=max_reqs,
            max_len=max_len,
            block_size=block_size,
            row_format=self.config.row_format(kv_dtype or self.dtype),
            device=self.device,
        )

    @torch.no_grad()
    def prefill_logits(
        self, prompts: Sequence[Sequence[int]], *, block_size: int = 16
    ) -> list[torch.Tensor]:
        """Logits ``[len_i, vocab]`` of each prompt, all prompts in one packed step."""
        cache = self.new_dense_cache(
            max_reqs=len(prompts), max_len=max(len(p) for p in prompts), block_size=block_size
        )
        step = cache.begin_step(range(len(prompts)), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        logits = self.logits(self(ids, step, cache))
        return list(logits.split([len(p) for p in prompts]))

    @torch.no_grad()
    def generate_greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        stop_ids: Sequence[int] = (),
        block_size: int = 16,
        kv_dtype: torch.dtype | str | None = None,
        cache: DenseGqaCache | None = None,
    ) -> list[list[int]]:
        """Greedy continuation of each prompt (packed prefill, then batched decode).

        A request stops after emitting a token of ``stop_ids`` (kept in its output) or after
        ``max_new_tokens``. A reference path for tests and small demos; the engine batches
        through the scheduler instead.
        """
        cache = cache or self.new_dense_cache(
            max_reqs=len(prompts),
            max_len=max(len(p) for p in prompts) + max_new_tokens,
            block_size=block_size,
            kv_dtype=kv_dtype,
        )
        outs: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        feed = [list(p) for p in prompts]
        stops = set(stop_ids)
        for _ in range(max_new_tokens):
            if not live:
                break
            step = cache.begin_step(live, [len(feed[r]) for r in live])
            ids = torch.tensor([t for r in live for t in feed[r]], device=self.device)
            hidden = self(ids, step, cache)
            last = torch.cumsum(torch.tensor([len(feed[r]) for r in live]), 0) - 1
            nxt = self.logits(hidden[last.to(self.device)]).argmax(-1).tolist()
            still = []
            for r, t in zip(live, nxt, strict=True):
                outs[r].append(int(t))
                feed[r] = [int(t)]
                if int(t) not in stops:
                    still.append(r)
            live = still
        return outs
