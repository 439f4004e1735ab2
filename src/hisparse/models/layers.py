"""Layers the model families share: RMS norm, the gated MLP, stacked projections and the
rotary helpers.

Each keeps transformers' order of operations; the CPU forms (`rms_norm`, `rope_full_width`)
are the same values in fewer ops.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; built on the meta device (a loader that assigns the weights
    next) without its random init, whose meta form imports ``torch._dynamo`` (seconds of a
    CPU start-up)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


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


class StackedLinear:
    """Bias-free ``nn.Linear`` modules of one input run as one matmul over a stacked weight
    (`fused_weight`: their parameters become views of it, no extra memory). Holds while the
    modules' weights still sit where stacking put them: a ``.to()`` or a reload copies them
    apart, and `valid` then says so (the caller runs the modules one by one)."""

    def __init__(self, mods: Sequence[nn.Linear]) -> None:
        self.mods = tuple(mods)
        self.weight, self._ptrs = fused_weight(self.mods, None)
        self.sizes = [m.weight.shape[0] for m in self.mods]

    def valid(self) -> bool:
        return tuple(m.weight.data_ptr() for m in self.mods) == self._ptrs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side, ``[..., Σ out]``."""
        return F.linear(x, self.weight)


def stackable(mods: Sequence[nn.Linear]) -> bool:
    """Whether `StackedLinear` can join ``mods``: plain ``nn.Linear`` (an fp8 layer's tile
    scales do not stack), bias-free, one input width, dtype and device."""
    if not all(type(m) is nn.Linear for m in mods):
        return False
    w = [m.weight for m in mods]
    return all(
        m.bias is None and x.shape[1] == w[0].shape[1] and x.dtype == w[0].dtype
        and x.device == w[0].device
        for m, x in zip(mods, w, strict=True)
    )  # fmt: skip


class MLP(nn.Module):
    """The gated MLP. After `stack_gate_up`, on CUDA (``HISPARSE_FUSED``), the gate and up
    projections run as one matmul over their stacked weights and ``silu · up`` as one
    kernel."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up: StackedLinear | None = None

    @torch.no_grad()
    def stack_gate_up(self) -> None:
        """One ``[gate ‖ up]`` weight; the two projections' weights become views of it (plain
        ``nn.Linear`` projections only: fp8 ones stay apart)."""
        if stackable((self.gate_proj, self.up_proj)):
            self.gate_up = StackedLinear((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up
        if gu is not None and not gu.valid():
            gu = self.gate_up = None  # copied apart since (``.to()``, a reload): drop it
        if gu is not None and env_backend("HISPARSE_FUSED", x.device) == "triton":
            from hisparse.models import fused  # (fused imports this module)

            return self.down_proj(fused.silu_mul(gu(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CachedRotary(nn.Module):
    """cos/sin of the rotary angles at given positions, from a table of every position once
    `build_table` made one (one gather a step instead of a chain of kernels; the table holds
    the same values: the same ops over the same positions). Subclasses define `angles`."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None  # [P, 2, R / 2]: cos, sin

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @torch.no_grad()
    def build_table(self, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """Tabulate positions ``[0, positions)`` (rounded up to a multiple of 4,096)."""
        n = -(-positions // 4096) * 4096
        cos, sin = self.angles(torch.arange(n, device=device), dtype)
        self.table = torch.stack((cos, sin), dim=1)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, max_len: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[N, R / 2]``; ``max_len`` bounds the positions (the table
        serves only when it covers them)."""
        t = self.table
        if (
            t is not None
            and max_len is not None
            and max_len <= t.shape[0]
            and t.dtype == dtype
            and t.device == positions.device
            and env_backend("HISPARSE_FUSED", positions.device) == "triton"
        ):
            cs = t[positions]
            return cs[:, 0], cs[:, 1]
        return self.angles(positions, dtype)


def fused_weight(
    mods: Sequence[nn.Linear], cached: tuple[torch.Tensor, tuple[int, ...]] | None
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(weight, addresses)``: one ``[Σ out, in]`` weight whose row blocks ARE the weights
    of ``mods`` (their parameters become views of it; one matmul instead of several, no
    extra memory), and the addresses of those views.

    ``cached`` (the last result) is returned while the modules' weights still sit at its
    addresses (the fused tensor keeps that memory, so nothing else can be there); after a
    load or a ``.to()`` replaced them, the weights are fused again. For one input row on the
    CPU, each output of the fused matmul equals the separate one bit for bit
    (tests/test_llama_cpu_decode.py checks the whole model)."""
    if cached is not None and tuple(m.weight.data_ptr() for m in mods) == cached[1]:
        return cached
    fused = torch.cat([m.weight.detach() for m in mods])
    row = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[row : row + n], requires_grad=m.weight.requires_grad)
        row += n
    return fused, tuple(m.weight.data_ptr() for m in mods)
