"""The model layers' fused ops (DSA and Llama), one dispatch point each: the Triton kernel of
`fused_triton` (norm, rotary, cache rows), `fused_indexer_triton` or `fused_ffn_triton`
for CUDA tensors, the torch composition it replaces (the reference) elsewhere.

Why: a decode step's layer launched hundreds of one- or two-microsecond torch kernels (norm,
rotary, Hadamard, quantisation and paged writes are each a chain of them), so the step ran
far above what its bytes cost. Each function here computes what its reference does in the
same order of operations; the RMS norm's and LayerNorm's sums, the router's weight
normalisation, the router's fp32 GEMV where the routing kernel computes its scores and the
indexer head weights' dot products run in another order (an ulp apart),
and routing ties go to the lowest expert. The lossless rule
holds because both placements run the same kernels. ``HISPARSE_FUSED=reference`` keeps the
torch compositions on CUDA, and the MoE's per-expert loop instead of its batched form (A/B
runs: the model's eager code as it was); ``triton`` on CPU tensors needs
``TRITON_INTERPRET=1``. Inputs a kernel does not handle fall back to the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hisparse.attention.dispatch import env_backend
from hisparse.attention.gqa_indexer_keys import write_index_keys
from hisparse.attention.gqa_indexer_reference import GqaIndexerFormat
from hisparse.attention.indexer_reference import hadamard_transform, quantize_indexer_fp8
from hisparse.kv.row_formats import (
    IndexerCacheFormat,
    MlaFormat,
    RowFormat,
    mla_format_name,
    pack_mla_rows,
    write_indexer_keys,
    write_rows_fast,
    write_rows_where,
)
from hisparse.models.layers import RMSNorm, rope_half_split, rope_interleaved
from hisparse.models.layers import rms_norm as rms_norm_reference

if TYPE_CHECKING:
    from hisparse.attention.sparse_gqa_reference import GqaRowFormat
    from hisparse.models.deepseek_v32 import Router

F32 = torch.float32
#: The largest router (experts x hidden) whose scores the routing kernel computes itself, one
#: program per row reading the whole fp32 weight (a few experts, as the benchmark presets);
#: a larger one (256 experts) gets cuBLAS's GEMV, spread over the SMs, and a sigmoid first.
ROUTE_ROWS_MAX_WEIGHTS = 1 << 16


def fused_on(t: Tensor) -> bool:
    """Whether ops on ``t``'s device take the fused forms (CUDA by default)."""
    return env_backend("HISPARSE_FUSED", t.device) == "triton"


def _triton(*tensors: Tensor) -> bool:
    return fused_on(tensors[0]) and all(t.stride(-1) == 1 for t in tensors)


def _kernels():  # type: ignore[no-untyped-def]
    from hisparse.models import fused_triton

    return fused_triton


def _indexer_kernels():  # type: ignore[no-untyped-def]
    from hisparse.models import fused_indexer_triton

    return fused_indexer_triton


def _ffn_kernels():  # type: ignore[no-untyped-def]
    from hisparse.models import fused_ffn_triton

    return fused_ffn_triton


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def add_rms_norm(norm: RMSNorm, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(s, norm(s))`` with ``s = x + residual`` (``s = x`` without one), rows ``[N, D]``."""
    same = residual is None or residual.dtype == x.dtype
    if x.dim() == 2 and same and _triton(x, *([residual] if residual is not None else [])):
        s, out = _kernels().rms_norm(x, norm.weight, norm.eps, residual)
        return (s if s is not None else x), out
    s = x + residual if residual is not None else x
    return s, rms_norm_reference(norm, s)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary of ``x [N, H, R]`` at angles ``cos/sin [N, R / 2]``; a new tensor."""
    if x.dim() == 3 and _pow2(x.shape[-1]) and cos.dtype == x.dtype and _triton(x):
        return _kernels().rope(x, cos, sin, interleaved)
    return (rope_interleaved if interleaved else rope_half_split)(x, cos, sin)


def _rope_prefix(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool) -> Tensor:
    rot = (rope_interleaved if interleaved else rope_half_split)(x[..., :rope_dim], cos, sin)
    return torch.cat((rot, x[..., rope_dim:]), dim=-1)


def gqa_rope_write(
    qkv: Tensor,
    heads: int,
    cos: Tensor,
    sin: Tensor,
    view: Tensor,
    slots: Tensor,
    row_format: GqaRowFormat,
    pages: Tensor,
    key_slots: Tensor,
    key_format: GqaIndexerFormat,
) -> Tensor:
    """A GQA layer's new tokens from ``qkv [N, (H + 2G) · D]`` (the stacked q, k, v
    projection; half-split rotary at ``cos/sin [N, D / 2]``): their K/V rows into ``view
    [NB, BS, row_bytes]`` at ``slots``, their keys into the ``fp8`` index ``pages`` at
    ``key_slots`` (``< 0`` skipped); returns the rotated queries ``[N, H, D]``."""
    if key_format.method != "fp8":
        raise ValueError(f"gqa_rope_write writes fp8 index keys, not {key_format.method!r}")
    n, g, d = qkv.shape[0], row_format.num_kv_heads, row_format.head_dim
    size = qkv.element_size()
    if (
        qkv.dim() == 2
        and qkv.shape[1] == (heads + 2 * g) * d
        and _pow2(d)
        and cos.shape[-1] * 2 == d
        and row_format.torch_dtype == qkv.dtype == cos.dtype
        and view.dtype == pages.dtype == torch.uint8
        and view.dim() == 3
        and view.stride(2) == 1
        and all(x % size == 0 for x in (*view.stride()[:2], view.storage_offset()))
        and _triton(qkv, view, pages)
    ):
        keys = pages.unflatten(1, (-1, key_format.row_bytes))
        return _kernels().gqa_rope_write(
            qkv, heads, g, cos, sin, view.view(qkv.dtype), slots, keys, key_slots
        )
    q = rope_half_split(qkv[:, : heads * d].view(n, heads, d), cos, sin)
    k = rope_half_split(qkv[:, heads * d : (heads + g) * d].view(n, g, d), cos, sin)
    v = qkv[:, (heads + g) * d :].view(n, g, d)
    write_rows_fast(view, slots, row_format.pack(k, v))
    write_index_keys(pages, key_format, key_slots, k, sync_free=True)
    return q


def _indexer_kernel_ok(x: Tensor, cos: Tensor, rope_dim: int, tile: int) -> bool:
    d = x.shape[-1]
    return (
        _pow2(d) and _pow2(tile) and d % tile == 0 and rope_dim % 2 == 0 and rope_dim <= d
        and cos.dtype == x.dtype
    )  # fmt: skip


def indexer_fp8_query(
    q: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool, tile: int
) -> tuple[Tensor, Tensor]:
    """The fp8 indexer's queries ``q [N, H, D]``: rotary on the first ``rope_dim`` values,
    Hadamard, e4m3 with power-of-two scales per ``tile`` -> ``(e4m3, scales [N, H, D/tile])``."""
    ok = q.dim() == 3 and _indexer_kernel_ok(q, cos, rope_dim, tile)
    if ok and _triton(q):
        return _indexer_kernels().indexer_fp8_query(q, cos, sin, rope_dim, interleaved, tile)
    q = _rope_prefix(q, cos, sin, rope_dim, interleaved)
    return quantize_indexer_fp8(hadamard_transform(q.float()), tile)


def indexer_fp8_write_keys(
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    rope_dim: int,
    interleaved: bool,
    pages: Tensor,
    fmt: IndexerCacheFormat,
    slots: Tensor,
    norm: nn.LayerNorm | None = None,
) -> None:
    """The fp8 indexer's keys ``k [N, D]`` (after ``norm``, the keys' LayerNorm, when given;
    then as `indexer_fp8_query`) written into ``pages`` at physical rows ``slots`` (``< 0``
    skipped)."""
    if fmt.kind != "fp8":
        raise ValueError("the fp8 indexer mode needs fp8 indexer pages")
    tile = fmt.tile
    norm_ok = norm is None or (
        norm.weight is not None and norm.bias is not None
        and norm.weight.dtype == norm.bias.dtype == k.dtype
        and tuple(norm.normalized_shape) == (k.shape[-1],)
    )  # fmt: skip
    if (
        k.dim() == 2
        and norm_ok
        and _indexer_kernel_ok(k, cos, rope_dim, tile)
        and _triton(k, pages)
    ):
        bs = pages.shape[1] // fmt.row_bytes
        ln = None if norm is None else (norm.weight, norm.bias, norm.eps)
        _indexer_kernels().indexer_fp8_write_keys(k, cos, sin, rope_dim, interleaved, tile,
                                                  pages, bs, slots, ln)  # fmt: skip
        return
    if norm is not None:
        k = norm(k)
    k = _rope_prefix(k, cos, sin, rope_dim, interleaved)
    k_fp8, k_scale = quantize_indexer_fp8(hadamard_transform(k.float()), tile)
    write_indexer_keys(pages, fmt, slots, k_fp8, k_scale)


def write_mla_rows(
    kv: Tensor,
    norm: RMSNorm,
    cos: Tensor,
    sin: Tensor,
    view: Tensor,
    slots: Tensor,
    row_format: MlaFormat,
) -> None:
    """The step's MLA rows from ``kv [N, C + R]`` (``kv_a_proj_with_mqa``'s output): RMS norm
    of the latent, interleaved rotary of the rope part, packed in ``row_format`` and written
    to ``view [NB, BS, row_bytes]`` at ``slots`` (``< 0`` skipped)."""
    c = norm.weight.shape[0]
    r = kv.shape[-1] - c
    name = mla_format_name(row_format)
    fp8 = name == RowFormat.FP8_DS_MLA.value
    if (
        (fp8 or name == RowFormat.BF16_MLA.value)
        and _pow2(c)
        and _pow2(r)
        and (not fp8 or c % 128 == 0)
        and kv.dim() == 2
        and norm.weight.dtype == kv.dtype == cos.dtype
        and _triton(kv, view)
    ):
        _kernels().write_mla_rows(kv, norm.weight, norm.eps, cos, sin, view, slots, fp8)
        return
    latent, k_pe = kv.split([c, r], dim=-1)
    latent = rms_norm_reference(norm, latent)
    k_pe = rope_interleaved(k_pe, cos, sin)
    write_rows_where(view, slots, pack_mla_rows(row_format, latent, k_pe))


def route_dense(router: Router, x: Tensor) -> tuple[Tensor, Tensor]:
    """The router's choice for rows ``x [N, H]`` as dense ``(weights [N, E] fp32, 0 where not
    chosen; chosen [N, E] bool)``. The kernel breaks ties toward the lowest expert or group
    (``torch.topk`` leaves them unspecified)."""
    e, g = router.weight.shape[0], router.n_group
    if fused_on(x) and _pow2(e) and _pow2(g) and e % g == 0:
        args = (router.e_score_correction_bias, g, router.topk_group, router.top_k,
                router.norm_topk_prob, router.scaling)  # fmt: skip
        w = router.weight
        if e * x.shape[1] <= ROUTE_ROWS_MAX_WEIGHTS and x.stride(-1) == 1 and w.dtype == F32:
            return _ffn_kernels().route_dense_rows(x, w, *args)
        scores = F.linear(x.float(), w.float()).sigmoid()
        return _ffn_kernels().route_dense(scores, *args)
    weights, ids = router(x)
    w = torch.zeros(x.shape[0], e, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
    chosen = torch.zeros(x.shape[0], e, dtype=torch.bool, device=x.device).scatter_(1, ids, True)
    return w, chosen


def moe_combine(y: Tensor, w: Tensor, chosen: Tensor, shared: Tensor) -> Tensor:
    """The MoE output from every expert's rows ``y [E, N, H]``: each chosen term
    ``(y[e] · w[:, e])`` in ``y``'s dtype added in ascending expert order (the per-expert
    loop's sums, rounded the same way), plus ``shared``."""
    if fused_on(y) and y.dim() == 3 and shared.dtype == y.dtype:
        return _ffn_kernels().moe_combine(y, w, chosen, shared)
    out = torch.zeros_like(shared)
    for e in range(y.shape[0]):
        term = (y[e] * w[:, e, None]).to(y.dtype)
        out = out + torch.where(chosen[:, e, None], term, 0.0)
    return out + shared


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` (the gate and up projections' outputs side
    by side, as one stacked matmul writes them)."""
    inter = gate_up.shape[-1] // 2
    rows_even = gate_up.dim() == 2 or gate_up.is_contiguous()
    floating = gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if rows_even and floating and gate_up.shape[-1] % 2 == 0 and _triton(gate_up):
        return _ffn_kernels().silu_mul(gate_up)
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


#: Rows up to which `indexer_head_weights` runs its GEMV kernel (a decode step's tokens);
#: more rows (a prefill chunk) take cuBLAS.
HEAD_WEIGHTS_MAX_ROWS = 64


def indexer_head_weights(proj: nn.Linear, x: Tensor, scale: float) -> Tensor:
    """The lightning indexer's per-head weights ``proj(x) · scale`` ``[N, H]`` in fp32
    (``proj``: the fp32 ``weights_proj``; ``x`` is cast to its dtype first)."""
    w = proj.weight
    if (
        proj.bias is None
        and w.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] <= HEAD_WEIGHTS_MAX_ROWS
        and _triton(x)
    ):
        return _indexer_kernels().head_weights(x, w, scale)
    return proj(x.to(w.dtype)).float() * scale
