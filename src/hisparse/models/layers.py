"""Layers the model families share: RMS norm, the gated MLP and the rotary helpers.

Each keeps transformers' order of operations; the CPU forms (`rms_norm`, `rope_full_width`)
are the same values in fewer ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.dispatch import env_backend


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back, then scaled (transformers' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; in fp32 on the CPU as one ``F.rms_norm`` (the same bits as `RMSNorm`'s
    six steps there, in one pass)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and norm.weight.dtype == x.dtype:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm(x)


def full_width_rope(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of `Rotary` widened to ``[N, D]`` once per step for `rope_full_width`:
    ``[cos ‖ cos]`` and ``[-sin ‖ sin]``."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rope_full_width(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_half_split` of ``x [N, heads, D]`` with `full_width_rope` tables, in 4 ops instead
    of 9: ``x·[c‖c] + [x2‖x1]·[-s‖s]`` is ``[x1·c - x2·s ‖ x2·c + x1·s]`` bit for bit
    (``a + (-b)`` is ``a - b`` in IEEE arithmetic, and each sum adds the same two products)."""
    c, s = cos[:, None, :], sin[:, None, :]
    return x * c + x.roll(x.shape[-1] // 2, dims=-1) * s


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` by angle ``i``; output keeps the interleaved layout.

    ``x [N, ..., R]``, ``cos/sin [N, R / 2]``. transformers returns the same values
    de-interleaved (evens then odds); dot products are the same, and keeping DeepSeek's own
    layout makes the cached RoPE bytes match other DeepSeek inference stacks.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``(x[i], x[i + R/2])`` by angle ``i`` (the non-interleaved, "rotate_half" form)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MLP(nn.Module):
    """The gated MLP. After `stack_gate_up`, on CUDA (``HISPARSE_FUSED``), the gate and up
    projections run as one matmul over their stacked weights."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2I, H] after stack_gate_up
        self._stack_ptrs: tuple[int, int] = (0, 0)

    @torch.no_grad()
    def stack_gate_up(self) -> None:
        """One ``[gate ‖ up]`` weight; the two projections' weights become views of it."""
        inter = self.gate_proj.weight.shape[0]
        gate_up = torch.cat((self.gate_proj.weight, self.up_proj.weight))
        self.gate_proj.weight = nn.Parameter(gate_up[:inter], requires_grad=False)
        self.up_proj.weight = nn.Parameter(gate_up[inter:], requires_grad=False)
        self.gate_up = gate_up
        self._stack_ptrs = self._ptrs()

    def _ptrs(self) -> tuple[int, int]:
        return self.gate_proj.weight.data_ptr(), self.up_proj.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up
        if gu is not None and self._ptrs() != self._stack_ptrs:
            gu = self.gate_up = None  # copied apart since (``.to()``, a reload): drop it
        if gu is not None and env_backend("HISPARSE_FUSED", x.device) == "triton":
            h = F.linear(x, gu)
            inter = gu.shape[0] // 2
            return self.down_proj(F.silu(h[..., :inter]) * h[..., inter:])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
