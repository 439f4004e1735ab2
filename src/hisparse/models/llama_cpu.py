"""The batch-1 CPU decode step of a Llama attention layer, and a CPU prefill's attention.

A batch-1 decode step on the CPU costs its call count, not its arithmetic: here the layer's
q, k and v come from one matmul, the rotation, row and key writes and the selection from one
compiled call, and the attention from one more (`CpuBackend.jit`), with `LlamaAttention`'s
general path as the fallback for anything they do not cover (docs/design.md §12.9).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from hisparse.attention.gqa_indexer_keys import FP8_DTYPE, FP8_MAX, write_index_keys
from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig, GqaIndexerFormat
from hisparse.attention.sparse_gqa_reference import (
    GqaRowFormat,
    causal_gqa_cpu,
    sparse_gqa_rows_cpu,
)
from hisparse.models.fused import fused_on
from hisparse.models.layers import fused_weight, rope_full_width
from hisparse.runtime.ops import cpu_backend
from hisparse.runtime.ops.cpu import F32

if TYPE_CHECKING:
    from hisparse.models.llama import GqaKVCache, LlamaForCausalLM
    from hisparse.models.llama_attention import Step, StepPlan


def sdpa_one_cpu(
    q: torch.Tensor,
    view: torch.Tensor,
    physical: torch.Tensor,
    scale: float,
    fmt: GqaRowFormat,
) -> torch.Tensor | None:
    """`_sdpa_decode_cpu` of one query whose rows are all valid: the same SDPA call on the
    same values, the rows gathered by one compiled copy (numpy without numba) into a buffer
    that every layer reuses. ``None`` where it does not apply."""
    g, d = fmt.num_kv_heads, fmt.head_dim
    h = q.shape[1]
    if fmt.torch_dtype != torch.float32 or q.dtype != torch.float32 or physical.shape[0] != 1:
        return None
    idx = physical.numpy()[0]
    k = idx.shape[0]
    if k == 0 or int(idx.min()) < 0 or view.dim() != 3 or view.shape[2] != fmt.row_bytes:
        return None
    strides = view.stride()
    if strides[-1] != 1 or view.storage_offset() % 4 or any(st % 4 for st in strides[:-1]):
        return None
    typed = view.numpy().view(np.float32)  # [blocks, block_size, 2·G·D]
    width = typed.shape[2]
    buf = cpu_backend().row_buffer(k, width)
    fns = cpu_backend().jit()
    if fns is not None:
        fns.gather_rows(typed, idx, buf.numpy())
    else:
        bs = typed.shape[1]
        buf.numpy()[:] = typed[idx // bs, idx % bs]
    keys, values = buf.view(1, k, 2, g, d).unbind(2)
    out = F.scaled_dot_product_attention(
        q.view(1, g, h // g, d), keys.transpose(1, 2), values.transpose(1, 2), scale=scale
    )
    return out.reshape(1, h, d)


def write_rows_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    view: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    idx_slots: torch.Tensor,
    rows_fmt: GqaRowFormat,
    fmt: GqaIndexerFormat,
) -> bool:
    """`write_rows_fast` of the packed rows and `write_index_keys` of ``k`` on the CPU in
    one compiled call (`write_rows_many` kernel: the same bytes; fp32 rows, fp8 keys).
    False where it does not apply (nothing written)."""
    fns = cpu_backend().jit()
    if (
        fns is None
        or k.device.type != "cpu"
        or fmt.method != "fp8"
        or rows_fmt.torch_dtype != torch.float32
        or k.dtype != torch.float32
        or v.dtype != torch.float32
    ):
        return False
    rows = cpu_backend().views.paged_rows(view, F32)
    keys = cpu_backend().views.paged_pages(pages, fmt.row_bytes)
    if rows is None or keys is None:
        return False
    return fns.write_rows_many(
        k.numpy(), v.numpy(), *rows, view.shape[0], slots.contiguous().numpy(), *keys,
        pages.shape[0], idx_slots.contiguous().numpy(),
    )  # fmt: skip


class CompiledViews(NamedTuple):
    """A layer's paged caches as the compiled decode kernels take them (`compiled_views`)."""

    kv: Any  # the attention cache (`finish_kv_update`, `swap_in`)
    slots: torch.Tensor  # each row's KV slot
    idx_slots: torch.Tensor  # each row's indexer-key slot
    read_pages: torch.Tensor  # the indexer pages the selection reads
    table: torch.Tensor  # their block table
    kv_rows: tuple  # the KV pool's rows (`paged_rows`)
    written: tuple  # the indexer pages written (`paged_pages`)
    read: tuple  # the indexer pages read (the written ones where they are the same)


def compiled_views(cache: GqaKVCache, layer: int, fmt: GqaIndexerFormat) -> CompiledViews | None:
    """``layer``'s KV and indexer pages as the compiled kernels read and write them, for the
    batch-1 step and the verify rows alike; None where the kernels do not cover the formats
    (fp8 index keys, fp32 rows) or a view is not plain memory (the torch path then runs)."""
    if fmt.method != "fp8" or cache.row_format.torch_dtype != torch.float32:
        return None
    kv = cache.attention(layer)
    view, slots = kv.write_target()
    idx = cache.indexer(layer)
    pages, idx_slots = idx.write_target()
    read_pages, table = idx.read_source()
    views = cpu_backend().views
    kv_rows = views.paged_rows(view, F32)
    written = views.paged_pages(pages, fmt.row_bytes)
    read = written if read_pages is pages else views.paged_pages(read_pages, fmt.row_bytes)
    if kv_rows is None or written is None or read is None:
        return None
    return CompiledViews(kv, slots, idx_slots, read_pages, table, kv_rows, written, read)


class OneTokenStep:
    """What every layer of a batch-1 CPU decode step shares (`StepPlan.memo`): the compiled
    functions, numpy views of the step's rotation tables and position, and scratch buffers
    each layer reuses (written and read within one layer's `forward_one_cpu`)."""

    def __init__(
        self, cos: torch.Tensor, sin: torch.Tensor, step: Step, heads: int, kv_heads: int,
        head_dim: int,
    ) -> None:  # fmt: skip
        self.fns = cpu_backend().jit()
        self.cos, self.sin = cos.numpy()[0], sin.numpy()[0]
        self.pos = int(step.positions.numpy()[0])
        self.lut = cpu_backend().fp8_lut()
        width = kv_heads * head_dim
        self.codes = np.empty(width, np.uint8)
        self.scratch = np.empty(width, np.float32)
        self.scratch_bits = self.scratch.view(np.uint32)
        self.q_rot = np.empty((heads, head_dim), np.float32)
        self.out_t = torch.empty(1, heads * head_dim)
        self.out = self.out_t.numpy().reshape(heads, head_dim)
        #: (step tensor, its first row as numpy): read once per step, not once per layer
        #: (every layer gets the same slot mappings and block table).
        self._rows: list[tuple[torch.Tensor, np.ndarray]] = []

    def row0(self, t: torch.Tensor) -> np.ndarray:
        """``t.numpy()[0]`` of a tensor of this step (the step's tensors are not written
        while its layers run), made once per tensor."""
        for known, row in self._rows:
            if known is t:
                return row
        row = t.numpy()[0]
        self._rows.append((t, row))
        return row


class LlamaAttentionCpu:
    """`LlamaAttention`'s CPU forms: the batch-1 decode step (`forward_one_cpu`) and a
    prefill's attention (`_attend_cpu`). A mixin: they read the layer's projections and
    settings, and fall back to its general path."""

    def forward_one_cpu(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: Step,
        cache: GqaKVCache,
        indexer: GqaIndexerConfig,
        plan: StepPlan,
    ) -> torch.Tensor:
        """`forward` of a batch-1 decode step on the CPU (one fp32 token, `full_width_rope`
        tables), through the same cache protocol with a handful of calls: q, k and v in one
        matmul, then (with numba, fp8 index keys, fp32 rows) one compiled call for the
        rotation, the row and index-key writes and the selection (`decode_pre` kernel) and
        one for the attention over the swapped-in rows, read in place
        (`attend_rows` kernel). Without numba, `_forward_one_torch`.

        The rotation and every written byte equal `forward`'s; the scored selection and the
        attention sum in another order (last-bit differences; both placements run the same
        code, so HiSparse stays lossless against the all-GPU placement)."""
        fmt = cache.indexer_format
        H, G, D = self.n_heads, self.n_kv, self.head_dim
        self._qkv = fused_weight((self.q_proj, self.k_proj, self.v_proj), self._qkv)
        qkv = F.linear(x, self._qkv[0])
        one = plan.memo.get("cpu_one")
        if one is None:
            one = plan.memo["cpu_one"] = OneTokenStep(cos, sin, step, H, G, D)
        fns = one.fns
        cv = None if fns is None else compiled_views(cache, self.layer, fmt)
        if cv is None:
            return self._forward_one_torch(qkv, cos, sin, step, cache, indexer, plan)
        kv, slots, idx_slots, read_pages, table, kv_rows, written, read = cv
        length = plan.longest
        top_k = indexer.top_k
        scored = top_k is not None and length > top_k
        width = min(top_k, length) if scored else length  # type: ignore[type-var]
        chosen = np.empty((1, width), np.int32)
        q_rot = one.q_rot
        ok = fns.decode_pre(
            qkv.numpy()[0], one.cos, one.sin, H, q_rot, *kv_rows, int(one.row0(slots)),
            *written, int(one.row0(idx_slots)), one.codes, one.scratch, one.scratch_bits,
            *read, one.row0(table), one.lut, length, one.pos, indexer.sink_tokens,
            indexer.recent_window, top_k or 0, self.scale, scored, chosen[0],
        )  # fmt: skip
        topk = torch.from_numpy(chosen)
        if not ok:
            q = torch.from_numpy(q_rot.copy()).view(1, H, D)
            topk = self._select(q, step, plan, read_pages, table, fmt, indexer, None)
        kv.finish_kv_update()
        physical = kv.swap_in(topk)
        fns.attend_rows(q_rot, *kv_rows, physical.numpy()[0], self.scale, one.out)
        return F.linear(one.out_t, self.o_proj.weight)

    def _forward_one_torch(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: Step,
        cache: GqaKVCache,
        indexer: GqaIndexerConfig,
        plan: StepPlan,
    ) -> torch.Tensor:
        """`forward_one_cpu` in torch and numpy (no numba, or formats it does not cover): the
        same values as `forward` bit for bit (the selection aside, compiled where numba is)."""
        H, G, D = self.n_heads, self.n_kv, self.head_dim
        qk = rope_full_width(qkv[:, : (H + G) * D].view(1, H + G, D), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + G) * D :]

        # 1. this step's row into the paged cache (k then v, fp32).
        kv = cache.attention(self.layer)
        view, slots = kv.write_target()
        slot = int(slots.numpy()[0])
        if slot >= 0:
            bs = view.shape[1]
            row = view[slot // bs, slot % bs].numpy().view(np.float32)
            row[: G * D] = k.numpy().reshape(-1)
            row[G * D :] = v.numpy().reshape(-1)
        kv.finish_kv_update()

        # 2. the index key (fp8 codes, as `write_index_keys`), then the logical top-k.
        fmt = cache.indexer_format
        idx = cache.indexer(self.layer)
        pages, idx_slots = idx.write_target()
        read_pages, table = idx.read_source()
        dims = self.index_dims if fmt.method == "lowrank" else None
        if fmt.method != "fp8":
            write_index_keys(pages, fmt, idx_slots, k, dims, sync_free=True)
        else:
            islot = int(idx_slots.numpy()[0])
            if islot >= 0:
                codes = k.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
                rb = fmt.row_bytes
                bs = pages.shape[1] // rb
                start = (islot % bs) * rb
                pages[islot // bs].numpy()[start : start + rb] = codes.numpy().reshape(-1)
        # (`gqa_indexer_topk` scores one CPU fp8 query in its compiled call where numba is)
        topk = self._select(q, step, plan, read_pages, table, fmt, indexer, dims)

        # 3./4. physical rows, then attention over them (one SDPA, as `_sdpa_decode_cpu`).
        physical = kv.swap_in(topk)
        out = sdpa_one_cpu(q, view, physical, self.scale, cache.row_format)
        if out is None:
            out = self._attend(q, step, plan, view, topk, physical, cache.row_format, indexer)
        return F.linear(out.reshape(1, H * D), self.o_proj.weight)

    def _attend_cpu(
        self,
        q: torch.Tensor,
        step: Step,
        plan: StepPlan,
        view: torch.Tensor,
        physical: torch.Tensor,
        fmt: GqaRowFormat,
        cfg: GqaIndexerConfig,
    ) -> torch.Tensor | None:
        """`_attend` of a CPU prefill step (``None``: no numba or rows it cannot read). The
        tokens that attend to every position up to their own (all of a request that fits
        in ``top_k``, else those before position ``top_k``) go through one fused causal
        attention per request (`causal_gqa_cpu`, transformers' kernel); the rest (scored
        selections, padding) each over their own rows (`sparse_gqa_rows_cpu`)."""
        tokens, lens = plan.tokens, plan.lens
        assert tokens is not None and lens is not None
        out = torch.empty_like(q)
        rest = torch.ones(q.shape[0], dtype=torch.bool)
        for r, length in enumerate(lens):
            tok = tokens[r][tokens[r] >= 0]
            if cfg.top_k is not None and length > cfg.top_k:
                tok = tok[step.positions[tok] < cfg.top_k]
            if tok.numel() == 0:
                continue
            dense = causal_gqa_cpu(
                q[tok], view, physical[tok], step.positions[tok], self.scale, fmt
            )
            if dense is not None:
                out[tok] = dense
                rest[tok] = False
        if bool(rest.all()):
            return sparse_gqa_rows_cpu(q, view, physical, self.scale, fmt)
        idx = torch.nonzero(rest).flatten()
        if idx.numel():
            sparse = sparse_gqa_rows_cpu(q[idx], view, physical[idx], self.scale, fmt)
            if sparse is None:
                return None
            out[idx] = sparse
        return out


def decode_one_cpu_applies(x: torch.Tensor, plan: StepPlan) -> bool:
    """A batch-1 fp32 decode step on the CPU (one token, no padding row): the shape
    `decode_one_cpu` serves. ``HISPARSE_CPU_FAST=0`` turns it off (A/B checks)."""
    return (
        cpu_backend().fast_decode
        and x.device.type == "cpu"
        and not fused_on(x)
        and x.shape[0] == 1
        and x.dtype == torch.float32
        and plan.decode
        and not plan.static
        and plan.lens is not None
        and len(plan.lens) == 1
    )


def decode_one_cpu(
    model: LlamaForCausalLM, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
    cache: GqaKVCache, plan: StepPlan,
) -> torch.Tensor:  # fmt: skip
    """The layers of a batch-1 CPU decode step with fewer ops than the general loop:
    `LlamaAttention.forward_one_cpu`, gate and up projections as one matmul, and each
    residual add with the RMS norm after it as one compiled call (`add_rms_norm` kernel;
    the add is exact, the norm's sum of squares rounds in another order: last-bit
    differences). Without numba the norms are ``F.rms_norm`` (the same bits in fp32 as
    `RMSNorm`'s steps) and the whole step equals the general loop bit for bit."""
    fns = cpu_backend().jit()
    shape = (model.config.hidden_size,)
    eps = model.config.rms_norm_eps
    eps32 = np.float32(eps)
    layers = model.model.layers
    norms = [ly.input_layernorm.weight for ly in layers]  # type: ignore[union-attr]
    norms.append(model.model.norm.weight)

    # With numba: the residual stream and the normed rows live in two buffers of this
    # step, updated in place (each add reads and writes the same element; the normed row
    # is consumed by the matmul after it before the next norm overwrites it).
    x_buf, h_buf = torch.empty_like(x), torch.empty_like(x)
    x_np, h_np = x_buf.numpy()[0], h_buf.numpy()[0]

    def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """``(x + delta, rms_norm(x + delta))`` (``delta`` None: ``x`` as it is)."""
        if fns is None:
            x = x if delta is None else x + delta
            return x, F.rms_norm(x, shape, weight, eps)
        fns.add_rms_norm(
            x.numpy()[0], x_np if delta is None else delta.numpy()[0], delta is not None,
            weight.detach().numpy(), eps32, x_np, h_np,
        )  # fmt: skip
        return x_buf, h_buf

    x, h = add_norm(x, None, norms[0])
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        a = attn.forward_one_cpu(h, cos, sin, step, cache, model.indexer, plan)
        x, h = add_norm(x, a, layer.post_attention_layernorm.weight)
        m = model._mlp(i, mlp, h)
        x, h = add_norm(x, m, norms[i + 1])
    return h
