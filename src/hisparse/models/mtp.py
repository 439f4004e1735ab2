"""DeepSeek's multi-token-prediction (MTP) layer, as the releases ship it, run as a drafter.

DeepSeek-V3.2 and GLM-5 ship one extra layer (index ``num_hidden_layers``) that predicts the
token after next from the main model's last hidden state and the next token's embedding
(DeepSeek reports the second token accepted 85-90% of the time). Its weights are a whole
decoder layer (MLA with its indexer, a MoE) plus ``enorm`` / ``hnorm`` (the two inputs' norms),
``eh_proj`` (``[2h -> h]`` over their concatenation, embedding first as vLLM and SGLang run
it) and ``shared_head.norm``. The embedding and the LM head are the main model's (the V3
paper shares them; the loader skips the checkpoint's copies, `loader.shared_copies`).

Row at position ``i``: ``g_i = layer(eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)]))`` with
``h_i`` the main model's final hidden state there (or, drafting further, the MTP output of
the row before), its own MLA rows and indexer keys at position ``i`` (a KV layer of the
engine's layout, `engine.mtp_drafts`), and the draft ``argmax(lm_head(norm(g_i)))``: the
token at ``i + 2``; the next draft runs the layer on ``(norm(g_i), draft)`` at ``i + 1``
(`MtpLayer.head`).
"""

from __future__ import annotations

import torch
from torch import nn

from hisparse.models import fused
from hisparse.models.deepseek_v32 import DecoderLayer, DsaForCausalLM, MoE
from hisparse.models.dsa_config import DsaConfig
from hisparse.models.kv_access import DsaKVCache, ForwardStep
from hisparse.models.layers import RMSNorm, embedding


class SharedHead(nn.Module):
    """The MTP layer's output norm and LM head."""

    def __init__(self, config: DsaConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None
        )


class MtpLayer(DecoderLayer):
    """Layer ``layer`` (``>= num_hidden_layers``) of a release: a decoder layer plus the MTP
    parts (module docstring); state-dict names under ``mtp.<i>.`` are the checkpoint's under
    ``model.layers.<layer>.``."""

    def __init__(
        self,
        config: DsaConfig,
        layer: int,
        *,
        sparse: bool,
        indexer: bool,
        own_embed: bool = True,
        own_head: bool = True,
    ) -> None:
        super().__init__(config, layer, sparse=sparse, indexer=indexer)
        h = config.hidden_size
        self.embed_tokens = embedding(config.vocab_size, h) if own_embed else None
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config, own_head)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self,
        model: DsaForCausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        step: ForwardStep,
        cache: DsaKVCache,
        *,
        rows_only: bool = False,
    ) -> torch.Tensor:
        """Outputs ``g [N, hidden]`` (before ``shared_head.norm``) of rows at
        ``step.positions`` from the previous hidden states ``hidden [N, hidden]`` and the
        tokens after them ``next_ids [N]``; writes the rows' KV and indexer keys through
        ``cache`` (this layer's index). Position 0's embedding is zeroed, as vLLM does.
        ``rows_only``: stop after the attention (the rows written are all the caller needs;
        what it returns then is no output)."""
        embed = self.embed_tokens if self.embed_tokens is not None else model.model.embed_tokens
        emb = embed(next_ids)
        emb = emb.masked_fill((step.positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], -1))
        cos, sin = model.rotary(step.positions, x.dtype, step.max_len)
        _, h = fused.add_rms_norm(self.input_layernorm, x)
        attn, _ = self.self_attn(h, cos, sin, step, cache, None, model.indexer_mode)
        if rows_only:
            return attn
        x, h = fused.add_rms_norm(self.post_attention_layernorm, x, attn)
        mlp = self.mlp(h, sync_free=step.static) if isinstance(self.mlp, MoE) else self.mlp(h)
        return x + mlp

    def head(self, model: DsaForCausalLM, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shared_head.norm(g), draft logits [N, vocab])`` of MTP outputs ``g`` (the
        shared LM head). The normed state is what the next draft step takes as its hidden
        state, as SGLang recycles it: the first step's is the main model's final normed state,
        so each step sees its input in the same form (vLLM passes ``g`` unnormed)."""
        normed = self.shared_head.norm(g)
        head = self.shared_head.head if self.shared_head.head is not None else model.lm_head
        return normed, head(normed)


def mtp_prefix(config: DsaConfig, index: int) -> str:
    """The checkpoint prefix of MTP layer ``index``: ``model.layers.<L + index>.``."""
    return f"model.layers.{config.num_hidden_layers + index}."
