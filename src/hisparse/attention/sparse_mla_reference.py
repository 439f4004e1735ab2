"""Reference sparse MLA attention over paged KV rows (absorbed / MQA form).

Every query head attends to the same ``top_k`` rows of one shared KV head: keys are the
576-dim ``[latent ‖ rope]`` rows, values are the 512-dim latents. The rows are read straight
from a paged ``uint8`` cache in any MLA row format and decoded here, exactly as the Triton
decode kernel will do in-register; this function is that kernel's oracle, and the model uses
it for prefill as well as decode (one code path, so prefill and decode cannot drift apart).
"""

from __future__ import annotations

import torch

from hisparse.kv.row_formats import MlaFormat, mla_row_bytes, unpack_mla_rows

#: Upper bound on the fp32 elements of one gathered chunk (bounds CPU memory on long prompts).
_CHUNK_ELEMENTS = 1 << 26


def gather_mla_rows(kv_cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., row_bytes]`` at physical indices (``block * block_size + offset``).

    ``kv_cache`` is ``[num_blocks, block_size, row_bytes]`` (any strides: token-major host
    views work too); negative indices read row 0 and must be masked by the caller.
    """
    bs = kv_cache.shape[1]
    safe = indices.long().clamp(min=0)
    return kv_cache[safe // bs, safe % bs]


def sparse_mla_decode_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: MlaFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over the rows ``indices`` selects, computed in fp32.

    Args:
        q_latent: ``[T, H, C]`` queries already multiplied into latent space (``q_nope W_UK``).
        q_rope: ``[T, H, R]`` RoPE part of the queries (rotated).
        kv_cache: ``[num_blocks, block_size, row_bytes]`` uint8 paged rows in ``row_format``.
        indices: ``[T, K]`` int physical rows per query token; ``-1`` entries are masked.
        scale: softmax scale applied to ``q · k`` (``qk_head_dim^-0.5`` times YaRN mscale²).
        row_format: ``fp8_ds_mla``, ``bf16`` or ``fp32``.

    Returns:
        ``out [T, H, C]`` in ``q_latent``'s dtype (the attention-weighted latents) and
        ``lse [T, H]`` fp32, the natural-log sum of exp of the scaled scores. A row with no
        valid index gives ``out = 0`` and ``lse = -inf``.
    """
    t, h, c = q_latent.shape
    r = q_rope.shape[-1]
    if q_rope.shape[:2] != (t, h) or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"shapes disagree: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, "
            f"indices {tuple(indices.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != mla_row_bytes(row_format, c, r):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not hold {row_format} rows of "
            f"{mla_row_bytes(row_format, c, r)} B"
        )
    k = indices.shape[1]
    out = torch.zeros(t, h, c, dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q_latent.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, k * (c + r + h)))
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        idx = indices[lo:hi]
        valid = idx >= 0
        latent, rope = unpack_mla_rows(row_format, gather_mla_rows(kv_cache, idx), c, r)
        # Masked entries read row 0 of the null block, which holds garbage (NaN bytes too):
        # zero them so 0-probability * NaN cannot leak into the output.
        latent = latent.masked_fill(~valid[..., None], 0.0)
        rope = rope.masked_fill(~valid[..., None], 0.0)
        scores = torch.einsum("thc,tkc->thk", q_latent[lo:hi].float(), latent)
        scores = scores + torch.einsum("thr,tkr->thk", q_rope[lo:hi].float(), rope)
        scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        finite = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp(scores - finite[..., None])  # masked entries: exp(-inf) = 0
        out[lo:hi] = torch.einsum("thk,tkc->thc", probs, latent).to(out.dtype)
        lse[lo:hi] = row_lse
    return out, lse
