"""Sparse attention and the lightning indexer: plain-PyTorch references (the oracles).

Triton kernels live next to these references and must reproduce them on the same inputs.
Callers go through `dispatch` (the kernel for CUDA tensors, the reference elsewhere, an
environment variable to force one); importing this package never imports Triton.
"""

from hisparse.attention.dispatch import sparse_mla_decode
from hisparse.attention.indexer_reference import (
    hadamard_transform,
    indexer_scores_exact,
    indexer_scores_fp8,
    indexer_topk,
    quantize_indexer_fp8,
)
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference

__all__ = [
    "hadamard_transform",
    "indexer_scores_exact",
    "indexer_scores_fp8",
    "indexer_topk",
    "quantize_indexer_fp8",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
]
