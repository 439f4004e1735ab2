"""DeepSeek's multi-token-prediction (MTP) layer, as the releases ship it: kept, not run yet.

DeepSeek-V3.2 and GLM-5 ship one extra layer (index ``num_hidden_layers``) that predicts the
token after next from the main model's last hidden state and the next token's embedding
(DeepSeek reports the second token accepted 85-90% of the time). Its weights are a whole
decoder layer (MLA with its indexer, a MoE) plus ``enorm`` / ``hnorm`` (the two inputs' norms),
``eh_proj`` (``[2h -> h]`` over their concatenation), ``shared_head`` (norm and LM head) and
its own ``embed_tokens``. The loader reads them into `MtpLayer` (sharded like the other
layers, fp8 kept fp8) under ``DsaForCausalLM.mtp`` so that speculative decoding can run them;
nothing calls them yet. A checkpoint without ``embed_tokens`` or ``shared_head.head`` in that
layer shares the main model's.
"""

from __future__ import annotations

from torch import nn

from hisparse.models.deepseek_v32 import DecoderLayer
from hisparse.models.dsa_config import DsaConfig
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


def mtp_prefix(config: DsaConfig, index: int) -> str:
    """The checkpoint prefix of MTP layer ``index``: ``model.layers.<L + index>.``."""
    return f"model.layers.{config.num_hidden_layers + index}."
