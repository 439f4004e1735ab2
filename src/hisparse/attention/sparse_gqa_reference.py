"""Reference sparse GQA attention over paged KV rows, and the GQA row format.

A GQA/MHA layer's cache row (docs/design.md §3) is one token's K then V of every KV head, in the
model dtype: ``[K_0 … K_{G-1} ‖ V_0 … V_{G-1}]``, ``row_bytes = 2 · G · D · itemsize``
(SmolLM2, G = 3, D = 64: 768 B in bf16, 1536 B in fp32; both multiples of 16). Every tier
stores these same bytes, so `GqaRowFormat.pack` / `unpack` are the single source of truth and
the Triton kernel decodes the same layout in-register.

`sparse_gqa_reference` is the oracle of that kernel and the model's attention for prefill and
decode alike: each query token attends to its own list of physical rows (``-1`` masked); query
head ``h`` reads KV head ``h // (H / G)``. With every earlier position listed it is exactly
dense causal attention (up to summation order).

On the CPU a prefill's tokens skip the reference: those that attend to every earlier
position go through torch's fused causal attention (`causal_gqa_cpu`), the others each read
their own rows in a compiled loop (`sparse_gqa_rows_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Model dtypes a GQA row may hold, by name.
GQA_ROW_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: Upper bound on the fp32 elements of one gathered chunk (bounds CPU memory on long prompts).
_CPU_CHUNK_ELEMENTS = 1 << 18
_CHUNK_ELEMENTS = 1 << 26


def gqa_dtype_name(dtype: torch.dtype | str) -> str:
    """``"fp32"`` / ``"bf16"`` / ``"fp16"`` for a dtype or one of those names."""
    if isinstance(dtype, str):
        if dtype not in GQA_ROW_DTYPES:
            raise ValueError(f"GQA row dtype {dtype!r}: expected one of {sorted(GQA_ROW_DTYPES)}")
        return dtype
    for name, dt in GQA_ROW_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"GQA rows cannot hold {dtype}; expected one of {sorted(GQA_ROW_DTYPES)}")


@dataclass(frozen=True)
class GqaRowFormat:
    """Byte layout of one token's K and V of all KV heads of one layer."""

    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        gqa_dtype_name(self.dtype)
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"bad GQA row shape: {self.num_kv_heads} heads x {self.head_dim}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return GQA_ROW_DTYPES[self.dtype]

    @property
    def kv_width(self) -> int:
        """Values of K (or V) per token: ``G · D``."""
        return self.num_kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return 2 * self.kv_width * self.torch_dtype.itemsize

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``k, v [..., G, D]`` -> rows ``[..., row_bytes]`` uint8."""
        want = (self.num_kv_heads, self.head_dim)
        if tuple(k.shape[-2:]) != want or k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)}: expected [..., {want}]")
        kv = torch.cat((k.flatten(-2), v.flatten(-2)), dim=-1).to(self.torch_dtype).contiguous()
        return kv.view(torch.uint8)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[..., row_bytes]`` uint8 -> ``(k, v)``, each ``[..., G, D]`` in the row dtype."""
        if rows.dtype != torch.uint8 or rows.shape[-1] != self.row_bytes:
            raise ValueError(
                f"GQA rows must be uint8 [..., {self.row_bytes}]; got {rows.dtype} "
                f"{tuple(rows.shape)}"
            )
        kv = rows.contiguous().view(self.torch_dtype)
        k, v = kv.split(self.kv_width, dim=-1)
        shape = (*rows.shape[:-1], self.num_kv_heads, self.head_dim)
        return k.reshape(shape), v.reshape(shape)


def _wide_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte (or 4-byte) words when the strides allow: a row gather then
    moves a few hundred words instead of a thousand single bytes (several times faster on the
    CPU)."""
    for dtype in (torch.int64, torch.int32):
        size = dtype.itemsize
        if (
            kv_cache.stride(-1) == 1
            and kv_cache.shape[-1] % size == 0
            and all(s % size == 0 for s in kv_cache.stride()[:-1])
            and kv_cache.storage_offset() % size == 0
        ):
            return kv_cache.view(dtype)
    return kv_cache


def gather_rows(kv_cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., row_bytes]`` uint8 at physical indices (``block * block_size + offset``).

    Negative indices read row 0 and must be masked by the caller.
    """
    return _index_rows(_wide_view(kv_cache), indices).view(torch.uint8)


def sparse_gqa_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse grouped-query attention over the rows ``indices`` selects, computed in fp32.

    Args:
        q: ``[T, H, D]`` queries (rotated); ``H`` a multiple of the row format's KV heads.
        kv_cache: ``[num_blocks, block_size, row_bytes]`` uint8 paged rows.
        indices: ``[T, K]`` int physical rows per query token; ``-1`` entries are masked.
        scale: softmax scale on ``q · k`` (``D^-0.5``).
        row_format: the rows' `GqaRowFormat`.

    Returns:
        ``out [T, H, D]`` in ``q``'s dtype and ``lse [T, H]`` fp32 (natural log). A row with no
        valid index gives ``out = 0`` and ``lse = -inf``.
    """
    t, h, d = q.shape
    g = row_format.num_kv_heads
    if d != row_format.head_dim or h % g or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, indices {tuple(indices.shape)}, "
            f"rows of {g} KV heads x {row_format.head_dim}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != row_format.row_bytes:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not hold {row_format.row_bytes} B GQA rows"
        )
    k = indices.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, k * (2 * g * d + h)))
    if t <= step:  # decode: one chunk, no output copy
        return _sparse_chunk(q, kv_cache, indices, scale, row_format)
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        out[lo:hi], lse[lo:hi] = _sparse_chunk(
            q[lo:hi], kv_cache, indices[lo:hi], scale, row_format
        )
    return out, lse


def _typed_rows(kv_cache: torch.Tensor, row_format: GqaRowFormat) -> torch.Tensor | None:
    """The pool viewed in the rows' dtype ``[blocks, block_size, 2·G·D]`` (None when the
    strides do not allow it): a gather then yields K and V directly."""
    size = row_format.torch_dtype.itemsize
    if kv_cache.stride(-1) != 1 or kv_cache.storage_offset() % size:
        return None
    if any(s % size for s in kv_cache.stride()[:-1]):
        return None
    return kv_cache.view(row_format.torch_dtype)


def _index_rows(typed: torch.Tensor, idx: torch.Tensor, *, nonneg: bool = False) -> torch.Tensor:
    """``typed[idx // bs, idx % bs]`` (negative indices read row 0; ``nonneg``: the caller
    knows there are none, so the clamp is skipped). When the block stride is
    a multiple of the row stride (any pool layout here), the pool is one strided 2-D view of
    "virtual rows" and a single ``index_select`` gathers several times faster than 2-D
    indexing."""
    nb, bs, width = typed.shape
    s_blk, s_row = typed.stride(0), typed.stride(1)
    safe = idx.long() if nonneg else idx.long().clamp(min=0)
    if s_row <= 0 or s_blk % s_row or typed.stride(2) != 1:
        return typed[safe // bs, safe % bs]
    per_block = s_blk // s_row
    rows = torch.as_strided(typed, ((nb - 1) * per_block + bs, width), (s_row, 1))
    # Blocks back to back (the dense cache): a physical row index is already a virtual one.
    virtual = safe if per_block == bs else (safe // bs) * per_block + safe % bs
    return rows.index_select(0, virtual.reshape(-1)).view(*idx.shape, width)


def _sparse_chunk(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_gqa_reference` of a few tokens, in as few ops as the math allows (the CPU
    decode step runs this once per layer)."""
    t, h, d = q.shape
    g = row_format.num_kv_heads
    invalid = idx < 0
    typed = _typed_rows(kv_cache, row_format)
    if typed is None:
        keys, values = row_format.unpack(gather_rows(kv_cache, idx))  # [t, K, G, D]
    else:
        kv = _index_rows(typed, idx)  # [t, K, 2·G·D]
        shape = (*idx.shape, g, d)
        keys, values = (x.reshape(shape) for x in kv.split(row_format.kv_width, dim=-1))
    # Masked entries read the null block's garbage (NaN bytes too): zero them so that
    # 0-probability * NaN cannot reach the output. (On the CPU a decode step usually has none
    # and the check is free: masking nothing costs more than the attention itself.)
    masked = q.device.type != "cpu" or bool(invalid.any())
    if masked:
        keys = torch.where(invalid[..., None, None], 0.0, keys)
        values = torch.where(invalid[..., None, None], 0.0, values)
    qg = q.float().view(t, g, h // g, d)
    scores = torch.einsum("tgqd,tkgd->tgqk", qg, keys.float()) * scale
    if masked:
        scores = torch.where(invalid[:, None, None, :], float("-inf"), scores)
    row_lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(row_lse), row_lse, 0.0)
    probs = torch.exp(scores - finite[..., None])  # masked entries: exp(-inf) = 0
    o = torch.einsum("tgqk,tkgd->tgqd", probs, values.float())
    return o.reshape(t, h, d).to(q.dtype), row_lse.reshape(t, h)


def selected_gqa_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor:
    """Attention of one request's tokens over the rows each selected, reading every row once.

    ``rows [U]`` are the physical rows of the union of the tokens' selections, in logical
    position order; ``selected [T, U]`` says which of them token ``t`` attends to. The same
    result as `sparse_gqa_reference` on the per-token selections (each position selected at
    most once), but a prefill of ``T`` tokens reads ``U`` rows instead of ``T * K``. Returns
    ``[T, H, D]`` in ``q``'s dtype; a token that selects nothing gets 0.
    """
    t, h, d = q.shape
    g = row_format.num_kv_heads
    keys, values = row_format.unpack(gather_rows(kv_cache, rows))  # [U, G, D]
    keys = keys.float().permute(1, 2, 0)  # [G, D, U]
    values = values.float().transpose(0, 1)  # [G, U, D]
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    u = rows.shape[0]
    step = max(1, _CHUNK_ELEMENTS // max(1, h * u))
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        qg = q[lo:hi].float().view(hi - lo, g, h // g, d).transpose(0, 1)  # [G, t, q, D]
        scores = torch.matmul(qg.reshape(g, -1, d), keys).view(g, hi - lo, h // g, u) * scale
        scores = torch.where(selected[None, lo:hi, None, :], scores, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        probs = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        o = torch.matmul(probs.view(g, -1, u), values)  # [G, t*q, D]
        out[lo:hi] = o.view(g, hi - lo, h // g, d).transpose(0, 1).reshape(hi - lo, h, d)
    return out


def selected_gqa_varlen_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor:
    """`selected_gqa_reference` of several requests at once (a batched prefill).

    ``q [R, T, H, D]``: request ``r``'s tokens, padded; ``rows [R, U]`` each request's union of
    selected physical rows in position order, ``-1`` padded; ``selected [R, T, U]`` which rows a
    token attends to (never a padding row). One batched matmul per chunk instead of a dozen
    small ops per request: what keeps a prefill of many prompts from being bound by launches.
    Returns ``[R, T, H, D]`` in ``q``'s dtype; a token that selects nothing gets 0.
    """
    n_req, t, h, d = q.shape
    g = row_format.num_kv_heads
    u = rows.shape[1]
    out = torch.zeros(n_req, t, h, d, dtype=q.dtype, device=q.device)
    if u == 0 or t == 0 or n_req == 0:
        return out
    keys, values = row_format.unpack(gather_rows(kv_cache, rows))  # [R, U, G, D]
    # Padding rows read the null block's garbage (NaN bytes too): their probabilities are 0,
    # but 0 * NaN is not, so zero their values.
    pad = (rows < 0)[:, :, None, None]
    keys = keys.float().permute(0, 2, 3, 1)  # [R, G, D, U]
    values = torch.where(pad, 0.0, values.float()).transpose(1, 2)  # [R, G, U, D]
    per_token = h * u
    # On the CPU, chunks whose scores fit in the cache (a few passes over them follow); on
    # an accelerator, as large as memory allows (fewer launches).
    limit = _CPU_CHUNK_ELEMENTS if q.device.type == "cpu" else _CHUNK_ELEMENTS
    t_step = max(1, min(t, limit // max(1, per_token)))
    r_step = max(1, limit // max(1, per_token * t_step))
    for r0 in range(0, n_req, r_step):
        r1 = min(n_req, r0 + r_step)
        for lo in range(0, t, t_step):
            hi = min(t, lo + t_step)
            m = hi - lo
            qg = q[r0:r1, lo:hi].float().view(r1 - r0, m, g, h // g, d).transpose(1, 2)
            qg = qg.reshape(r1 - r0, g, m * (h // g), d)
            scores = torch.matmul(qg, keys[r0:r1]).view(r1 - r0, g, m, h // g, u) * scale
            sel = selected[r0:r1, None, lo:hi, None, :]
            # One fused softmax; a row that selects nothing (NaN) is zeroed below.
            probs = torch.softmax(torch.where(sel, scores, float("-inf")), dim=-1)
            o = torch.matmul(probs.view(r1 - r0, g, m * (h // g), u), values[r0:r1])
            o = o.view(r1 - r0, g, m, h // g, d).transpose(1, 2).reshape(r1 - r0, m, h, d)
            out[r0:r1, lo:hi] = o.to(q.dtype)
    return torch.where(selected.any(-1)[..., None, None], out, 0.0)


def causal_gqa_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor:
    """Dense causal attention of one request: query at position ``p`` reads ``rows[: p + 1]``.

    `selected_gqa_reference` with every earlier position selected (``rows [L]`` physical, in
    position order). Returns ``[T, H, D]`` in ``q``'s dtype.
    """
    s = torch.arange(rows.shape[0], device=q.device)
    selected = s[None, :] <= positions[:, None]
    return selected_gqa_reference(q, kv_cache, rows, selected, scale, row_format)


def _sdpa_decode_cpu(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor | None:
    """``out`` of `sparse_gqa_reference` for a CPU step with no masked entry, in three ops: one
    row gather, then torch's fused ``scaled_dot_product_attention`` over ``[T, G, H/G, K]``
    (query head ``h`` reads KV head ``h // (H / G)``: the GQA groups are the SDPA heads). The
    reference spends a dozen and more small ops per layer on the same math (measured slower
    at SmolLM2's batch-1 decode). ``None`` when it does not apply (masked entries, rows whose
    dtype cannot be viewed, shape mismatch); the caller then runs the reference.
    """
    t, h, d = q.shape
    g = row_format.num_kv_heads
    if (
        d != row_format.head_dim
        or h % g
        or indices.dim() != 2
        or indices.shape[0] != t
        or q.dtype != torch.float32
        or row_format.torch_dtype != torch.float32
        or kv_cache.dim() != 3
        or kv_cache.shape[2] != row_format.row_bytes
    ):
        return None
    typed = _typed_rows(kv_cache, row_format)
    if typed is None or indices.shape[1] == 0 or bool((indices < 0).any()):
        return None
    kv = _index_rows(typed, indices, nonneg=True)  # [T, K, 2·G·D]
    keys, values = kv.view(t, indices.shape[1], 2, g, d).unbind(2)  # [T, K, G, D] each
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(t, g, h // g, d), keys.transpose(1, 2), values.transpose(1, 2), scale=scale
    )
    return out.reshape(t, h, d)


def sparse_gqa_rows_cpu(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor | None:
    """``out`` of `sparse_gqa_reference` for a CPU step of many tokens (a prefill), compiled:
    each token's rows read in place from the pool by the batch-1 decode step's attention
    (`attend_rows` kernel, ``-1`` masked), the tokens split over torch's thread count. A token
    costs its ``K`` rows, not the whole prefix: no gathered ``[T, K, row]`` copy, no union of
    the tokens' rows with a ``[T, U]`` mask. Per token the sums run in one fixed order
    (`_dots` kernel, then over the rows in index order), so the result does not depend on
    the step's other tokens or on where the rows sit. ``None`` where it does not apply (no
    numba, not fp32, a pool whose strides are not whole fp32 items); the caller then runs
    the reference."""
    from hisparse.runtime.ops import cpu_backend
    from hisparse.runtime.ops.cpu import F32

    fns = cpu_backend().jit()
    t, h, d = q.shape
    g = row_format.num_kv_heads
    if (
        fns is None
        or q.device.type != "cpu"
        or q.dtype != torch.float32
        or row_format.torch_dtype != torch.float32
        or d != row_format.head_dim
        or h % g
        or indices.dim() != 2
        or indices.shape[0] != t
        or kv_cache.dim() != 3
        or kv_cache.shape[2] != row_format.row_bytes
    ):
        return None
    rows = cpu_backend().views.paged_rows(kv_cache, F32)
    if rows is None:
        return None
    out = torch.empty(t, h, d)
    qn = q.detach().contiguous().numpy()
    idx = indices.contiguous().numpy()
    fns.attend_rows_many(qn, *rows, idx, float(scale), out.numpy(), cpu_backend().parts())
    return out


def causal_gqa_cpu(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    row_format: GqaRowFormat,
) -> torch.Tensor | None:
    """``out`` of `sparse_gqa_reference` for CPU tokens of one request that each attend to
    every position up to their own (a budget at least the context, or the tokens before
    position ``top_k``): torch's fused causal ``scaled_dot_product_attention`` over the
    request's rows, read once, as transformers runs it (a chunk after earlier ones masks
    by position: the same bits). ``None`` where the rows are not such a prefix (checked
    by `is_causal_prefix` kernel: a selection replaced in ``swap_in``) or not viewable."""
    from hisparse.runtime.ops import cpu_backend

    fns = cpu_backend().jit()
    t, h, d = q.shape
    g = row_format.num_kv_heads
    typed = _typed_rows(kv_cache, row_format) if kv_cache.dim() == 3 else None
    if fns is None or typed is None or t == 0 or q.dtype != row_format.torch_dtype:
        return None
    if d != row_format.head_dim or h % g or kv_cache.shape[2] != row_format.row_bytes:
        return None
    last = int(torch.argmax(positions))
    length = int(positions[last]) + 1
    ref = indices[last, :length].contiguous()
    if not fns.is_causal_prefix(indices.contiguous().numpy(), positions.numpy(), ref.numpy()):
        return None
    kv = _index_rows(typed, ref, nonneg=True)  # [L, 2·G·D]
    keys, values = (x.view(length, g, d).transpose(0, 1)[None] for x in kv.split(g * d, -1))
    whole = t == length and bool((positions == torch.arange(length)).all())
    mask = None if whole else torch.arange(length)[None, :] <= positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=whole, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)
