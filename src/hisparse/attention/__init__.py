"""Sparse attention and the lightning indexer: plain-PyTorch references (the oracles).

Triton kernels live next to these references and must reproduce them on the same inputs.
`sparse_mla_decode` is the one entry point callers use: the Triton kernel for CUDA tensors,
the reference elsewhere; ``HISPARSE_ATTENTION=reference`` forces the reference everywhere
(A/B checks, debugging), ``HISPARSE_ATTENTION=triton`` forces the kernel (CPU tensors then need
``TRITON_INTERPRET=1`` set before Triton is imported). Triton is imported lazily, on the
first CUDA call, so importing this package never imports it.
"""

import torch

from hisparse.attention.backend import env_backend
from hisparse.attention.indexer_reference import (
    hadamard_transform,
    indexer_scores_exact,
    indexer_scores_fp8,
    indexer_topk,
    quantize_indexer_fp8,
)
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference
from hisparse.kv.row_formats import MlaFormat


def _attention_backend(device: torch.device) -> str:
    """``triton`` or ``reference`` for tensors on ``device`` (``HISPARSE_ATTENTION`` decides)."""
    return env_backend("HISPARSE_ATTENTION", device)


def sparse_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: MlaFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA (contract of `sparse_mla_decode_reference`) on the best backend available.

    Inputs the kernel does not handle (the fp32 test format, latent widths other than 512,
    a non-contiguous byte dim) and machines without Triton fall back to the reference.
    """
    if _attention_backend(q_latent.device) == "triton":
        try:
            from hisparse.attention import sparse_mla_triton as smt
        except ImportError:  # pragma: no cover - Triton missing: the reference still works
            smt = None
        if smt is not None and smt.supports(q_latent, q_rope, kv_cache, row_format):
            return smt.sparse_mla_decode_triton(
                q_latent, q_rope, kv_cache, indices, scale, row_format
            )
    return sparse_mla_decode_reference(q_latent, q_rope, kv_cache, indices, scale, row_format)


__all__ = [
    "hadamard_transform",
    "indexer_scores_exact",
    "indexer_scores_fp8",
    "indexer_topk",
    "quantize_indexer_fp8",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
]
