"""W8A8 block-scaled fp8: the formats and the reference that defines every fp8 GEMM's result.

The releases of DeepSeek-V3.2 (and DeepSeek-format fp8 checkpoints of GLM-5) keep each linear
weight as e4m3 with one fp32 factor per 128 x 128 tile (``weight_scale_inv``,
``quantization_config.weight_block_size``); the engines that serve them quantize activations
per token in groups of 128 columns (DeepSeek's ``act_quant``) and run block-scaled GEMMs. The
references here define what hisparse's kernels compute (`fp8_triton`, and
``torch._scaled_mm`` on sm90, `fp8_linear`):

* `act_quant`: per row and 128-column group, ``amax`` floored at 1e-4, scale ``amax × (1/448)``
  (rounded up to a power of two from its exponent bits where the checkpoint's
  ``quantization_config.scale_fmt`` is ``ue8m0``, as V3.1 / V3.2 ship), values ``x / scale``
  clamped to ±448 before the e4m3 cast (torch on the CPU saturates there, Triton's interpreter
  does not), rounded to nearest even.
* `block_gemm`: ``out[m, n] = Σ_kb (Σ_{k ∈ kb} qx[m, k] · qw[n, k]) · sx[m, kb] · sw[n', kb]``,
  the partial product of each 128-wide K block in fp32, times the activation's then the
  weight's scale, added block after block (DeepSeek's ``fp8_gemm`` order); kernels differ only
  in the order of the fp32 sums inside a block.

A weight slice kept by a tensor-parallel rank may start inside a 128-row scale tile:
``row_offset`` (``start % 128``) places its rows in the tiles (`tile_range`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hisparse.kv.row_formats import ceil_pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Side of the square weight-scale tiles and width of an activation scale group.
BLOCK = 128
#: DeepSeek's ``act_quant`` floors each group's amax here (an all-zero row stays finite).
ACT_MIN_AMAX = 1e-4


class Fp8FormatError(ValueError):
    """A ``quantization_config`` hisparse cannot serve; the message names the field."""


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's fp8 recipe (``config.json: quantization_config``)."""

    #: activation scales rounded up to powers of two (``scale_fmt: ue8m0``)
    pow2_scales: bool = False
    block: tuple[int, int] = (BLOCK, BLOCK)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Fp8Format | None:
        """The recipe of a config.json dict, or None when it declares no fp8 quantization."""
        q = cfg.get("quantization_config") or {}
        if not q:
            return None
        method = q.get("quant_method", "fp8")
        if method != "fp8":
            raise Fp8FormatError(
                f"quantization_config.quant_method={method!r}: hisparse serves DeepSeek's "
                "block-scaled 'fp8' format (or unquantized checkpoints)"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"quantization_config.fmt={fmt!r}: only 'e4m3' is served")
        block = tuple(int(b) for b in q.get("weight_block_size") or (BLOCK, BLOCK))
        if block != (BLOCK, BLOCK):
            raise Fp8FormatError(
                f"quantization_config.weight_block_size={list(block)}: the fp8 kernels tile "
                f"weights in {BLOCK} x {BLOCK} blocks"
            )
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise Fp8FormatError(
                f"quantization_config.activation_scheme={scheme!r}: activations are "
                "quantized per token at run time ('dynamic')"
            )
        return cls(pow2_scales=q.get("scale_fmt") == "ue8m0", block=(BLOCK, BLOCK))

    @classmethod
    def of_checkpoint(cls, path: str | Path) -> Fp8Format | None:
        """`from_config` of ``path/config.json``."""
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    def config_entry(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint in this recipe declares (DeepSeek's)."""
        entry: dict[str, Any] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(self.block),
        }
        if self.pow2_scales:
            entry["scale_fmt"] = "ue8m0"
        return entry


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_range(start: int, length: int, block: int = BLOCK) -> tuple[int, int]:
    """``(first, count)`` of the scale tiles covering elements ``[start, start + length)``."""
    first = start // block
    return first, cdiv(start + length, block) - first


def scale_rows(n: int, row_offset: int = 0) -> int:
    """Scale-tile rows of a weight slice of ``n`` rows starting ``row_offset`` into a tile."""
    return cdiv(row_offset + n, BLOCK)


def act_quant(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [M, K], fp32 scales [M, ceil(K / 128)])`` of rows ``x [M, K]`` (the last group
    may be partial): DeepSeek's ``act_quant`` (module docstring)."""
    m, k = x.shape
    groups = cdiv(k, BLOCK)
    xf = x.float()
    if k % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, groups * BLOCK - k))
    xt = xf.view(m, groups, BLOCK)
    amax = xt.abs().amax(dim=-1).clamp(min=ACT_MIN_AMAX)
    scale = amax * (1.0 / FP8_MAX)
    if pow2:
        scale = ceil_pow2(scale)
    q = (xt / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * BLOCK)[:, :k], scale


def weight_scales_per_row(scale_inv: torch.Tensor, n: int, row_offset: int = 0) -> torch.Tensor:
    """``[..., n, Kt]``: each weight row's scale of each K block (``scale_inv [..., Nt, Kt]``)."""
    rows = (torch.arange(n, device=scale_inv.device) + row_offset) // BLOCK
    return scale_inv.float().index_select(-2, rows)


def block_gemm(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    row_offset: int = 0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[M, N]`` of quantized activations ``qx [M, K]`` / ``sx [M, Kt]`` and an e4m3 weight
    ``qw [N, K]`` with tile scales ``sw [Nt, Kt]``: the fp32 partial product of each K block,
    times ``sx`` then the weight's scale, summed block by block (module docstring)."""
    m, k = qx.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"activations of width {k} against a weight of width {qw.shape[1]}")
    w_rows = weight_scales_per_row(sw, n, row_offset)  # [N, Kt]
    acc = torch.zeros(m, n, dtype=torch.float32, device=qx.device)
    for kb in range(cdiv(k, BLOCK)):
        lo, hi = kb * BLOCK, min(k, (kb + 1) * BLOCK)
        part = qx[:, lo:hi].float() @ qw[:, lo:hi].float().t()
        acc += part * sx[:, kb, None] * w_rows[None, :, kb]
    return acc.to(out_dtype)


def w8a8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    *,
    pow2: bool = False,
    row_offset: int = 0,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` as W8A8 computes it (`act_quant`, then `block_gemm`), in x's dtype."""
    qx, sx = act_quant(x, pow2)
    return block_gemm(qx, sx, qw, sw, row_offset, out_dtype=x.dtype)


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, row_offset: int = 0, col_offset: int = 0
) -> torch.Tensor:
    """fp32 ``[..., N, K]`` of an e4m3 weight and its tile scales ``[..., Nt, Kt]``
    (DeepSeek's ``weight_dequant``), rows and columns placed ``row_offset`` / ``col_offset``
    into the first tile (a slice of a larger weight)."""
    n, k = weight.shape[-2:]
    s = weight_scales_per_row(scale_inv, n, row_offset)  # [..., N, Kt]
    s = s.repeat_interleave(BLOCK, dim=-1)[..., col_offset : col_offset + k]
    return weight.float() * s


def quantize_weight(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., N, K], fp32 scale_inv [..., Nt, Kt])``: one factor per 128 x 128 tile,
    ``amax / 448`` (a power of two at or above it with ``pow2``, as ue8m0 checkpoints keep);
    an all-zero tile gets factor 1. How `hisparse make-tiny --fp8` writes weights."""
    *lead, n, k = w.shape
    nt, kt = cdiv(n, BLOCK), cdiv(k, BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, kt * BLOCK - k, 0, nt * BLOCK - n))
    tiles = wf.view(*lead, nt, BLOCK, kt, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    if pow2:
        scale = ceil_pow2(scale)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nt * BLOCK, kt * BLOCK)[..., :n, :k].contiguous(), scale


def grouped_block_gemm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    experts: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    *,
    a_div: int = 1,
    row_offset: int = 0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[P, N]``: row ``p`` is `block_gemm` of activation row ``p // a_div`` against expert
    ``experts[p]``'s weight (``qw [E, N, K]``, ``sw [E, Nt, Kt]``): the grouped GEMM of a MoE
    whose (token, expert) pairs are ``experts`` (``[P]``, a token's ``a_div`` choices in a
    row)."""
    out = torch.empty(experts.numel(), qw.shape[1], dtype=out_dtype, device=qa.device)
    for e in experts.unique().tolist():
        pairs = (experts == e).nonzero().squeeze(1)
        rows = pairs // a_div
        out[pairs] = block_gemm(qa[rows], sa[rows], qw[e], sw[e], row_offset, out_dtype)
    return out
