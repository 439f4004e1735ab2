"""The attention and indexer dispatch points: each op's Triton kernel for CUDA tensors, its
reference elsewhere, unless an environment variable forces one for A/B checks and debugging
(``HISPARSE_ATTENTION``: sparse MLA and sparse GQA; ``HISPARSE_MLA_KERNEL=triton``: sparse MLA
on the Triton kernel where the Gluon one would run; ``HISPARSE_INDEXER``: the lightning
indexer; ``HISPARSE_GQA_INDEXER``: the fused GQA decode indexer; ``HISPARSE_TOPK``: the
lightning indexer's top-k, Triton's radix select or ``torch.topk``). ``triton`` on CPU tensors
needs ``TRITON_INTERPRET=1`` set before Triton is imported. Triton modules are imported on
first use, so importing this module never imports Triton; inputs a kernel does not handle and
machines without Triton fall back to the reference.
"""

from __future__ import annotations

import torch

from hisparse import envs
from hisparse.attention.gqa_indexer_reference import (
    GqaIndexerConfig,
    GqaIndexerFormat,
    gqa_indexer_topk_decode_reference,
)
from hisparse.attention.indexer_reference import indexer_topk_paged_reference
from hisparse.attention.sparse_gqa_reference import (
    GqaRowFormat,
    _sdpa_decode_cpu,
    sparse_gqa_reference,
)
from hisparse.attention.sparse_mla_reference import sparse_mla_decode_reference
from hisparse.attention.v4_attention_reference import v4_attention_paged_reference
from hisparse.kv.row_formats import IndexerCacheFormat, MlaFormat


def env_backend(var: str, device: torch.device) -> str:
    """``triton`` or ``reference`` for tensors on ``device``, as ``var`` decides
    (`hisparse.envs`)."""
    return envs.backend(var, device.type)


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

    On Hopper, calls on 16-byte aligned ``fp8_ds_mla`` rows go to the Gluon kernel
    (``HISPARSE_MLA_KERNEL=triton`` keeps them on the Triton one). Inputs the kernels do not
    handle (the fp32 test format, latent widths other than 512, a non-contiguous byte dim) and
    machines without Triton fall back to the reference.
    """
    if _attention_backend(q_latent.device) == "triton":
        try:
            from hisparse.attention import sparse_mla_triton as smt
        except ImportError:  # pragma: no cover - Triton missing: the reference still works
            smt = None
        if smt is not None and _use_gluon_mla(q_latent, q_rope, kv_cache, row_format):
            from hisparse.attention import sparse_mla_gluon as smg

            return smg.sparse_mla_decode_gluon(q_latent, q_rope, kv_cache, indices, scale)
        if smt is not None and smt.supports(q_latent, q_rope, kv_cache, row_format):
            return smt.sparse_mla_decode_triton(
                q_latent, q_rope, kv_cache, indices, scale, row_format
            )
    return sparse_mla_decode_reference(q_latent, q_rope, kv_cache, indices, scale, row_format)


def _use_gluon_mla(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, row_format: MlaFormat
) -> bool:
    """Whether the Gluon sparse MLA kernel takes this call (``HISPARSE_MLA_KERNEL`` decides:
    ``auto``, the default, where it runs and is faster; ``triton`` never)."""
    if envs.value("HISPARSE_MLA_KERNEL") == "triton" or q_latent.device.type != "cuda":
        return False
    from hisparse.attention import sparse_mla_gluon as smg
    from hisparse.kv.row_formats import mla_format_name

    return (
        smg.supported(q_latent.device)
        and mla_format_name(row_format) == "fp8_ds_mla"
        and q_latent.shape[-1] == smg.LATENT_DIM
        and q_rope.shape[-1] == smg.ROPE_DIM
        and kv_cache.dim() == 3
        and kv_cache.shape[2] == smg.ROW_BYTES
        and smg.rows_aligned(kv_cache)
    )


def sparse_gqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
    *,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse GQA (contract of `sparse_gqa_reference`) on the best backend available.

    ``need_lse=False`` (the model's decode step reads only ``out``): on the CPU with the
    reference backend, `_sdpa_decode_cpu` computes ``out`` in one fused call and ``lse`` is
    ``None``. CUDA runs what it runs with ``need_lse=True``.

    The Triton kernel (`sparse_gqa_triton`) for CUDA tensors, the reference elsewhere;
    ``HISPARSE_ATTENTION=reference|triton`` forces one, as for sparse MLA. Inputs the kernel
    does not handle (head dims that are not a power of two, a non-contiguous byte dim) and
    machines without Triton fall back to the reference. Triton is imported on first use.
    """
    if not need_lse and q.device.type == "cpu" and _attention_backend(q.device) != "triton":
        out = _sdpa_decode_cpu(q, kv_cache, indices, scale, row_format)
        if out is not None:
            return out, None
    if sparse_gqa_kernel_takes(q, kv_cache, row_format):
        from hisparse.attention import sparse_gqa_triton as sgt

        return sgt.sparse_gqa_decode_triton(q, kv_cache, indices, scale, row_format)
    return sparse_gqa_reference(q, kv_cache, indices, scale, row_format)


def v4_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    indices: torch.Tensor,
    n_window: int,
    entry_col: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """DeepSeek-V4 attention over pool rows (contract of `v4_attention_paged_reference`): the
    Triton kernel (`v4_attention_triton`) for CUDA tensors, the reference elsewhere;
    ``HISPARSE_ATTENTION`` forces one, as for sparse MLA and GQA."""
    if _attention_backend(q.device) == "triton":
        try:
            from hisparse.attention import v4_attention_triton as v4t
        except ImportError:  # pragma: no cover - Triton missing: the reference still works
            v4t = None
        if v4t is not None and v4t.supports(q, pool, entry_col):
            return v4t.v4_attention_triton(q, pool, indices, n_window, entry_col, sinks, scale)
    return v4_attention_paged_reference(q, pool, indices, n_window, entry_col, sinks, scale)


def sparse_gqa_kernel_takes(
    q: torch.Tensor, kv_cache: torch.Tensor, row_format: GqaRowFormat
) -> bool:
    """Whether `sparse_gqa_decode` runs the Triton kernel on these inputs (the backend is
    ``triton``, Triton imports, the kernel takes the shapes)."""
    if _attention_backend(q.device) != "triton":
        return False
    try:
        from hisparse.attention import sparse_gqa_triton as sgt
    except ImportError:  # pragma: no cover - Triton missing: the reference still works
        return False
    return sgt.supports(q, kv_cache, row_format)


def indexer_backend(device: torch.device) -> str:
    """``triton`` or ``reference`` for tensors on ``device`` (``HISPARSE_INDEXER`` decides)."""
    return env_backend("HISPARSE_INDEXER", device)


def indexer_topk_paged(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    weights: torch.Tensor,
    pages: torch.Tensor,
    fmt: IndexerCacheFormat,
    block_table: torch.Tensor,
    req_index: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    softmax_scale: float,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """`indexer_topk_paged_reference`'s contract on the best backend available.

    CUDA tensors use the Triton kernel (`hisparse.attention.indexer_triton`), others the
    reference; ``HISPARSE_INDEXER=reference|triton`` forces one (CPU tensors with ``triton``
    need ``TRITON_INTERPRET=1``). Inputs the kernel does not handle fall back to the
    reference. The kernel scores keys up to ``max_len`` when the caller knows it on the host;
    else, outside CUDA-graph capture, up to the longest request of the batch (one host read of
    ``seq_lens``), and under capture the whole block table. Both backends score the query
    tokens in row blocks of at most `SCORE_BLOCK_BYTES` (`score_row_blocks`), so a long
    prefill chunk never holds its whole ``[T, S]`` scores at once; the result is the same.
    """
    if indexer_backend(q.device) == "triton":
        try:
            from hisparse.attention import indexer_triton as it
        except ImportError:  # pragma: no cover - Triton missing: the reference still works
            it = None
        if it is not None and it.supports(q, q_scale, pages, fmt):
            capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if max_len is None and not capturing and seq_lens.numel():
                max_len = int(seq_lens.max())
            return it.indexer_topk_paged_triton(
                q, q_scale, weights, pages, fmt, block_table, req_index, positions,
                top_k, softmax_scale, max_len=max_len,
            )  # fmt: skip
    return indexer_topk_paged_reference(
        q, q_scale, weights, pages, fmt, block_table, req_index, positions, seq_lens,
        top_k, softmax_scale,
    )  # fmt: skip


def gqa_indexer_topk_decode(
    q: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    longest: int,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
    scale: float,
    width: int,
    dims: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gqa_indexer_topk_decode_reference`'s contract on the best backend available: fp8 on
    CUDA runs the fused Triton kernels of `gqa_indexer_triton` (``HISPARSE_GQA_INDEXER=
    reference`` keeps the reference)."""
    if gqa_indexer_kernel_takes(q, pages, tables, fmt, cfg):
        from hisparse.attention import gqa_indexer_triton as git

        return git.gqa_indexer_topk_decode_triton(
            q, positions, pages, tables, lengths, longest, fmt, cfg, scale, width
        )
    return gqa_indexer_topk_decode_reference(
        q, positions, pages, tables, lengths, longest, fmt, cfg, scale, width, dims
    )


def gqa_indexer_kernel_takes(
    q: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    fmt: GqaIndexerFormat,
    cfg: GqaIndexerConfig,
) -> bool:
    """Whether `gqa_indexer_topk_decode` runs the Triton kernels on these inputs (the fp8
    method, the backend ``triton``, Triton imports, the kernels take the shapes)."""
    if fmt.method != "fp8" or env_backend("HISPARSE_GQA_INDEXER", q.device) != "triton":
        return False
    try:
        from hisparse.attention import gqa_indexer_triton as git
    except ImportError:  # pragma: no cover - Triton missing: the reference still works
        return False
    return git.supports(q, pages, tables, fmt, cfg)
