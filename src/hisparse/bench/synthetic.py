"""Benchmark-only synthetic prefill: KV rows and indexer keys written without a forward pass.

A 128K-token prompt through the reference prefill takes far longer than the decode a
benchmark wants to measure. A synthetic prefill step writes each prompt token's rows exactly
where a real prefill would (through the same per-layer prefill caches: `write_target`, then
`finish_kv_update`, which mirrors them to the host pool, drops stale hot copies and keeps the
tail pages' rows on the GPU) and
its indexer keys into the indexer pages, all valid packed rows of the active formats made from
pseudo-random latents. Values are a hash of (seed, request key, layer, position, element), so
both placements hold identical caches whatever the chunking. The first output token is a hash
of the request key too: no logits exist, so time to first token is not measured.
"""

from __future__ import annotations

import torch

from hisparse.attention.indexer_reference import quantize_indexer_fp8
from hisparse.bench.replay import hash_rows, mix31, mix31_int
from hisparse.kv.row_formats import pack_mla_rows, write_indexer_keys, write_rows_where

_M31 = 0x7FFFFFFF


def synthetic_values(
    seed: int, salt: int, keys: torch.Tensor, positions: torch.Tensor, width: int
) -> torch.Tensor:
    """fp32 ``[T, width]`` in ``[-1, 1)`` for tokens (request key, position)."""
    s = mix31_int(mix31_int(seed + 77) ^ mix31_int(salt))
    base = mix31(mix31((keys & _M31) ^ s) ^ (positions & _M31))
    cols = torch.arange(width, device=keys.device, dtype=torch.int64)
    return hash_rows(base, cols).to(torch.float32) * (2.0 / 2**31) - 1.0


def first_token(seed: int, key: int, vocab_size: int) -> int:
    """The synthetic prefill's first output token of a request."""
    return mix31_int(mix31_int(seed + 991) ^ key) % vocab_size


class SyntheticPrefill:
    """Writes a prefill step's rows for a DSA model (MLA rows + indexer keys)."""

    def __init__(self, model: torch.nn.Module, row_format: object, seed: int) -> None:
        cfg = getattr(model, "config", None)
        if not hasattr(cfg, "kv_lora_rank") or not hasattr(cfg, "indexer_full"):
            raise ValueError(
                "synthetic prefill supports DSA checkpoints (deepseek_v32 / glm_moe_dsa); "
                "use prefill='model' for other models."
            )
        self.model, self.row_format, self.seed = model, row_format, seed
        self.c, self.rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim  # type: ignore[union-attr]
        self.dtype = next(model.parameters()).dtype

    def write(
        self,
        caches: list,
        indexer_pages: dict[int, torch.Tensor],
        idx_slots: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Write rows of tokens (``keys[t]``, ``positions[t]``) for every layer.

        ``caches[i]`` is layer ``i``'s cache of the step (``write_target`` /
        ``finish_kv_update``, as the model's layer uses it); ``idx_slots`` the indexer row of
        each token."""
        fmt_idx = self.model.indexer_format  # type: ignore[attr-defined]
        for layer, cache in enumerate(caches):
            view, slots = cache.write_target()
            latent = synthetic_values(self.seed, 3 * layer, keys, positions, self.c)
            rope = synthetic_values(self.seed, 3 * layer + 1, keys, positions, self.rope)
            rows = pack_mla_rows(
                self.row_format,
                latent.to(self.dtype),  # type: ignore[arg-type]
                rope.to(self.dtype),
            )
            write_rows_where(view, slots, rows)
            cache.finish_kv_update()
            if layer in indexer_pages:
                k = synthetic_values(self.seed, 3 * layer + 2, keys, positions, fmt_idx.head_dim)
                if fmt_idx.kind == "fp8":
                    q, scale = quantize_indexer_fp8(k, fmt_idx.tile)
                    write_indexer_keys(indexer_pages[layer], fmt_idx, idx_slots, q, scale)
                else:
                    write_indexer_keys(indexer_pages[layer], fmt_idx, idx_slots, k)
