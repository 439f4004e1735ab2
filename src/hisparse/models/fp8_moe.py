"""A MoE's routed experts in fp8: stacked e4m3 weights, one grouped GEMM per projection.

A release's 256 experts per layer are ~97% of its weights, and a decode step's tokens choose
few of them each, so the experts run as grouped GEMMs over the (token, expert) pairs sorted by
expert (vLLM's fused-MoE shape): `moe_align` lays the pairs out expert after expert, each
expert's run padded to whole blocks of rows, with torch ops that read nothing back to the host;
`fp8_triton.grouped_gemm` launches a grid fixed by the pair count, each program one block of
one expert (programs past the last block return), so the fixed-shape decode path stays
sync-free and CUDA-graph capturable (design §12.6). Per layer: the tokens' activations are
quantized once, the gate and up projections write the two halves of one ``[pairs, 2I]``
buffer, ``silu(gate) · up`` is quantized for the down projection, whose rows land at their
pair's index, and each token adds its experts' rows weighted by the router in slot order.

``HISPARSE_FP8_MOE=auto|reference|triton``: the Triton path on GPUs with fp8 tensor cores
(and the CPU under ``TRITON_INTERPRET=1`` when asked for), else `forward_reference`, the same
terms per expert with torch (it reads the chosen experts back to the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse import envs
from hisparse.models import fp8
from hisparse.models.fp8 import BLOCK, cdiv, scale_rows
from hisparse.models.fp8_linear import note_kernel, triton_fp8_ok
from hisparse.runtime.ops.triton_common import next_pow2

MOE_ENV = "HISPARSE_FP8_MOE"


def moe_backend(device: torch.device) -> str:
    """``triton`` or ``reference`` for experts on ``device`` (module docstring)."""
    choice = envs.value(MOE_ENV)
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_fp8_ok(device) else "reference"
    return choice


def block_rows(pairs: int, n_experts: int) -> int:
    """Rows of one grouped-GEMM program: 16 for a decode step's few pairs per expert, up to
    64 for a prefill chunk's many (a power of two: `moe_align` pads each expert to it)."""
    return min(64, max(16, next_pow2(cdiv(pairs, n_experts))))


def moe_align(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, block_expert)`` of the (token, expert) pairs ``ids [N, k]`` (pair ``p`` is
    token ``p // k``'s choice ``p % k``): ``slots [S]`` int32 lists the pairs expert after
    expert, each expert's run padded with ``N·k`` to a multiple of ``block_m``;
    ``block_expert [S / block_m]`` int32 is each block's expert, ``n_experts`` past the last.
    ``S`` depends only on ``N·k`` (at most ``min(E, N·k)`` experts have pairs), and nothing
    is read back to the host."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), ids.device
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first position in sorted order
    dest = (ends - padded)[expert] + torch.arange(p, device=dev) - first[expert]
    cap = cdiv(p + min(n_experts, p) * (block_m - 1), block_m) * block_m
    slots = torch.full((cap,), p, dtype=torch.int32, device=dev)
    slots[dest] = order.to(torch.int32)
    starts = torch.arange(0, cap, block_m, device=dev)
    return slots, torch.searchsorted(ends, starts, right=True).to(torch.int32)


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, H]``: each token's expert rows ``y [N·k, H]`` weighted by ``weights [N, k]``,
    summed over its k choices in slot order, in fp32."""
    n, k = weights.shape
    return (y.view(n, k, -1).float() * weights.float().unsqueeze(-1)).sum(1).to(dtype)


class Fp8Experts(nn.Module):
    """``E`` routed experts (gate, up: ``[E, I, H]``; down: ``[E, H, I]``, e4m3) with their
    tile scales, stacked as the grouped GEMMs read them. ``row_offset``: where a
    tensor-parallel rank's gate and up rows start inside their first scale tile."""

    def __init__(
        self, n_experts: int, hidden: int, inter: int, *, row_offset: int = 0, pow2: bool = False
    ) -> None:
        super().__init__()
        self.n_experts, self.hidden, self.inter = n_experts, hidden, inter
        self.row_offset, self.pow2 = row_offset, pow2
        #: the checkpoint index of expert 0 here (expert parallelism keeps a range)
        self.first_expert = 0
        e8 = fp8.FP8_DTYPE

        def param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        up_tiles = (n_experts, scale_rows(inter, row_offset), cdiv(hidden, BLOCK))
        self.gate_weight = param(n_experts, inter, hidden, dtype=e8)
        self.gate_scale = param(*up_tiles)
        self.up_weight = param(n_experts, inter, hidden, dtype=e8)
        self.up_scale = param(*up_tiles)
        self.down_weight = param(n_experts, hidden, inter, dtype=e8)
        self.down_scale = param(n_experts, cdiv(hidden, BLOCK), cdiv(inter, BLOCK))

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, hidden={self.hidden}, inter={self.inter}, "
            f"row_offset={self.row_offset}, pow2={self.pow2}"
        )

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``[N, H]``: the routed experts' weighted sum for tokens ``x [N, H]`` choosing
        ``ids [N, k]`` with ``weights [N, k]``, in ``out_dtype`` (default ``x``'s; expert
        parallelism keeps its fp32 partial sums)."""
        if moe_backend(x.device) == "reference":
            note_kernel("grouped_reference")
            return self.forward_reference(x, weights, ids, out_dtype)
        note_kernel("grouped_triton")
        return self.forward_grouped(x, weights, ids, out_dtype)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        from hisparse.models import fused

        if fused.fused_on(gu):
            return fused.silu_mul(gu)
        i = self.inter
        return F.silu(gu[:, :i]) * gu[:, i:]

    def forward_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The Triton path: `moe_align`, then three grouped GEMMs (no host sync)."""
        from hisparse.models import fp8_triton as kt

        n, k = ids.shape
        p, i = n * k, self.inter
        bm = block_rows(p, self.n_experts)
        slots, block_expert = moe_align(ids, self.n_experts, bm)
        if x.stride(-1) != 1:
            x = x.contiguous()
        qx, sx = kt.act_quant(x, self.pow2)
        gu = torch.empty(p, 2 * i, dtype=x.dtype, device=x.device)
        for w, s, cols in ((self.gate_weight, self.gate_scale, gu[:, :i]),
                           (self.up_weight, self.up_scale, gu[:, i:])):  # fmt: skip
            kt.grouped_gemm(qx, sx, slots, block_expert, bm, w, s, cols,
                            a_div=k, row_offset=self.row_offset)  # fmt: skip
        qh, sh = kt.act_quant(self._silu_mul(gu), self.pow2)
        y = torch.empty(p, self.hidden, dtype=x.dtype, device=x.device)
        kt.grouped_gemm(qh, sh, slots, block_expert, bm, self.down_weight, self.down_scale, y)
        return combine(y, weights, out_dtype or x.dtype)

    def forward_reference(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The same terms per chosen expert with `fp8.w8a8_linear` (reads ``ids`` on the host)."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        y = torch.empty(n * k, self.hidden, dtype=x.dtype, device=x.device)
        for e in flat.unique().tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            xe = x[pairs // k]
            g = fp8.w8a8_linear(xe, self.gate_weight[e], self.gate_scale[e], pow2=self.pow2,
                                row_offset=self.row_offset)  # fmt: skip
            u = fp8.w8a8_linear(xe, self.up_weight[e], self.up_scale[e], pow2=self.pow2,
                                row_offset=self.row_offset)  # fmt: skip
            h = self._silu_mul(torch.cat((g, u), dim=-1))
            y[pairs] = fp8.w8a8_linear(h, self.down_weight[e], self.down_scale[e], pow2=self.pow2)
        return combine(y, weights, out_dtype or x.dtype)
