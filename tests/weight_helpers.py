"""The weights a loaded model keeps, as ``hisparse plan`` counts them: the MTP layers'
embedding and LM head once (DeepSeek-V3's MTP shares them with the model; a loader that
still holds the checkpoint's copies holds them apart)."""

from __future__ import annotations

import torch


def mtp_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of the MTP layers' own embedding and LM head held apart from the model's."""
    mine = {id(p) for p in [*model.model.embed_tokens.parameters(), *model.lm_head.parameters()]}
    return sum(
        p.numel() * p.element_size()
        for layer in model.mtp
        for part in (layer.embed_tokens, layer.shared_head.head)
        if part is not None
        for p in part.parameters()
        if id(p) not in mine
    )


def kept_weight_bytes(model: torch.nn.Module) -> int:
    """The weights a rank keeps, the MTP layers' embedding and head counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) - mtp_copy_bytes(model)
