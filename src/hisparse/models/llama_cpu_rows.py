"""The CPU verify step of speculative decoding: one request's last token and its drafts, k + 1
consecutive rows, through the batch-1 decode kernels one row at a time.

A verifying step is a decode step with several rows per request (docs/design.md §12.11).
The general multi-token path (a prefill's selection and attention, the batched resolve) costs
several one-row fast-path steps on the CPU; here each row takes exactly the batch-1 step's
kernels (`decode_pre`: rotary, row and index-key writes, selection; `attend_rows`; the fused
add and RMS norm), in position order, so a row sees the rows and keys of the rows before it
as the one-row step would; the rows' swap-in is one resolve against the request's hot
buffer, and their attentions share the threads (`attend_rows_many`). The matmuls take all
rows at once; with ``ROWWISE_MATMUL`` they run row by row, each rounding like the one-row
step's, so every row's hidden state and logits equal the one-row step's bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from hisparse.models.fused import fused_on
from hisparse.models.layers import fused_weight
from hisparse.models.llama_cpu import compiled_views
from hisparse.runtime.ops import cpu_backend

if TYPE_CHECKING:
    from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
    from hisparse.models.llama import GqaKVCache, LlamaForCausalLM
    from hisparse.models.llama_attention import LlamaAttention, Step, StepPlan

#: Most rows a verify step of this path takes (the largest ``num_speculative_tokens`` + 1).
MAX_ROWS = 17

#: Each row's matmuls (and, in `ModelRunner.run`, its logits) as its own one-row matmul:
#: the one-row step's rounding, so every row equals that step's bit for bit. Off (the
#: default): one matmul over the rows, rounded apart from the one-row step's in the last bits
#: (greedy tokens may then differ only at a near-tie of the logits), and cheaper: the row
#: loop's matmuls were the largest part of a verify step (docs/benchmarks.md §22).
ROWWISE_MATMUL = False


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` of ``x [T, in]``: one one-row matmul per row where
    ``ROWWISE_MATMUL`` (each row rounds as a batch-1 step's does), else one matmul."""
    if not ROWWISE_MATMUL or x.shape[0] == 1:
        return F.linear(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    wt = weight.t()
    for t in range(x.shape[0]):
        torch.mm(x[t : t + 1], wt, out=out[t : t + 1])
    return out


def verify_logits_cpu(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of one request's verify rows on the CPU (any model): with
    ``ROWWISE_MATMUL`` one row at a time, each rounded as a one-row step's logits."""
    if not ROWWISE_MATMUL:
        return model.logits(hidden)  # type: ignore[operator]
    return torch.cat([model.logits(hidden[t : t + 1]) for t in range(hidden.shape[0])])  # type: ignore[operator]


class RowsStep:
    """What every layer of a CPU verify step shares (`StepPlan.memo`): the compiled kernels,
    numpy views of the rows' rotation tables, positions, write slots and block-table row, and
    scratch buffers each layer reuses."""

    def __init__(
        self, cos: torch.Tensor, sin: torch.Tensor, step: Step, heads: int, kv_heads: int,
        head_dim: int,
    ) -> None:  # fmt: skip
        self.fns = cpu_backend().jit()
        self.cos, self.sin = cos.numpy(), sin.numpy()
        self.pos = step.positions.numpy()
        rows = self.pos.shape[0]
        self.lut = cpu_backend().fp8_lut()
        self.parts = min(cpu_backend().parts(), rows)
        width = kv_heads * head_dim
        self.codes = np.empty(width, np.uint8)
        self.scratch = np.empty(width, np.float32)
        self.scratch_bits = self.scratch.view(np.uint32)
        self.q_rot = np.empty((rows, heads, head_dim), np.float32)
        self.out_t = torch.empty(rows, heads * head_dim)
        self.out = self.out_t.numpy().reshape(rows, heads, head_dim)
        self._arrays: list[tuple[torch.Tensor, np.ndarray]] = []

    def array(self, t: torch.Tensor) -> np.ndarray:
        """``t.numpy()`` of a tensor of this step, made once per tensor (every layer gets
        the same slot mappings and block table)."""
        for known, arr in self._arrays:
            if known is t:
                return arr
        arr = t.numpy()
        self._arrays.append((t, arr))
        return arr


def forward_rows_cpu(
    attn: LlamaAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    step: Step,
    cache: GqaKVCache,
    indexer: GqaIndexerConfig,
    plan: StepPlan,
) -> torch.Tensor:
    """`LlamaAttention.forward` of a CPU verify step (one request, consecutive rows, fp32):
    each row through `decode_pre` as the batch-1 step runs it (its length is its position
    + 1, so its selection is the one a one-row step at that position makes), one swap-in of
    every row's selection, then `attend_rows` per row. Formats the kernels do not cover go
    to the general path (`LlamaAttention.forward`)."""
    fmt = cache.indexer_format
    H, G, D = attn.n_heads, attn.n_kv, attn.head_dim
    rs = plan.memo.get("cpu_rows")
    if rs is None:
        rs = plan.memo["cpu_rows"] = RowsStep(cos, sin, step, H, G, D)
    fns = rs.fns
    cv = None if fns is None else compiled_views(cache, attn.layer, fmt)
    if cv is None:
        return attn.forward(x, cos, sin, step, cache, indexer, plan)
    kv, slots, idx_slots, read_pages, table, kv_rows, written, read = cv
    attn._qkv = fused_weight((attn.q_proj, attn.k_proj, attn.v_proj), attn._qkv)
    qkv = linear_rows(x, attn._qkv[0]).numpy()
    T = x.shape[0]
    top_k = indexer.top_k
    longest = plan.longest
    width = min(top_k, longest) if top_k is not None and longest > top_k else longest
    chosen = np.full((T, width), -1, np.int32)
    slot_a, islot_a = rs.array(slots), rs.array(idx_slots)
    table_row = rs.array(table)[0]
    all_ok = True
    for t in range(T):
        pos = int(rs.pos[t])
        length = pos + 1  # the keys a one-row step at this position sees
        scored = top_k is not None and length > top_k
        w = min(top_k, length) if scored else length  # type: ignore[type-var]
        all_ok &= fns.decode_pre(
            qkv[t], rs.cos[t], rs.sin[t], H, rs.q_rot[t], *kv_rows, int(slot_a[t]),
            *written, int(islot_a[t]), rs.codes, rs.scratch, rs.scratch_bits, *read,
            table_row, rs.lut, length, pos, indexer.sink_tokens, indexer.recent_window,
            top_k or 0, attn.scale, scored, chosen[t, :w],
        )  # fmt: skip
    topk = torch.from_numpy(chosen)
    if not all_ok:  # a row the compiled selection declines: the general selection, every row
        q = torch.from_numpy(rs.q_rot.copy())
        topk = attn._select(q, step, plan, read_pages, table, fmt, indexer, None)
    kv.finish_kv_update()
    physical = kv.swap_in(topk).contiguous().numpy()
    # each row `attend_rows` over its own rows, the rows shared out over the threads
    fns.attend_rows_many(rs.q_rot, *kv_rows, physical, attn.scale, rs.out, rs.parts)
    return linear_rows(rs.out_t, attn.o_proj.weight)


def decode_rows_cpu_applies(x: torch.Tensor, step: Step, plan: StepPlan) -> bool:
    """A CPU verify step (`ForwardStep.verify`) of one request in fp32: the shape
    `decode_rows_cpu` serves (with numba; without it the general path runs).
    ``HISPARSE_CPU_FAST=0`` turns it off with the batch-1 path."""
    return (
        step.verify
        and cpu_backend().fast_decode
        and cpu_backend().jit() is not None
        and x.device.type == "cpu"
        and not fused_on(x)
        and 1 < x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and not plan.static
        and plan.lens is not None
        and len(plan.lens) == 1
    )


def decode_rows_cpu(
    model: LlamaForCausalLM, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
    cache: GqaKVCache, plan: StepPlan,
) -> torch.Tensor:  # fmt: skip
    """The layers of a CPU verify step, `decode_one_cpu`'s ops for each row: the attention
    (`forward_rows_cpu`), gate and up projections as one weight, and each residual add with
    the RMS norm after it as one compiled call per row (`add_rms_norm`)."""
    fns = cpu_backend().jit()
    assert fns is not None, "decode_rows_cpu_applies checks for the compiled kernels"
    T = x.shape[0]
    eps32 = np.float32(model.config.rms_norm_eps)
    layers = model.model.layers
    norms = [ly.input_layernorm.weight.detach().numpy() for ly in layers]  # type: ignore[union-attr]
    norms.append(model.model.norm.weight.detach().numpy())
    x_buf, h_buf = torch.empty_like(x), torch.empty_like(x)
    x_np, h_np = x_buf.numpy(), h_buf.numpy()

    def add_norm(delta: torch.Tensor | None, weight: np.ndarray) -> None:
        """``x_buf += delta`` (``None``: as it is) and ``h_buf = rms_norm(x_buf)``, row by row."""
        d = x_np if delta is None else delta.numpy()
        for t in range(T):
            fns.add_rms_norm(x_np[t], d[t], delta is not None, weight, eps32, x_np[t], h_np[t])

    x_buf.copy_(x)
    add_norm(None, norms[0])
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        a = forward_rows_cpu(attn, h_buf, cos, sin, step, cache, model.indexer, plan)  # type: ignore[arg-type]
        add_norm(a, layer.post_attention_layernorm.weight.detach().numpy())  # type: ignore[union-attr]
        fused = fused_weight((mlp.gate_proj, mlp.up_proj), model._gate_up.get(i))  # type: ignore[union-attr]
        model._gate_up[i] = fused
        gu = linear_rows(h_buf, fused[0])
        inter = gu.shape[1] // 2
        m = linear_rows(F.silu(gu[:, :inter]) * gu[:, inter:], mlp.down_proj.weight)  # type: ignore[union-attr]
        add_norm(m, norms[i + 1])
    return h_buf
