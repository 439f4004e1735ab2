"""DeepSeek-V4's release weight formats and their dequantization.

The release keeps most linear weights as e4m3 with one UE8M0 scale per 128 x 128 tile, and the
routed experts as 4-bit e2m1 values (two per byte, low nibble first) with one UE8M0 scale per
32 values of a row (``quantization_config.expert_dtype: fp4``). A UE8M0 scale is a bare exponent
byte: ``2 ** (byte - 127)`` (stored as ``uint8`` or torch's ``float8_e8m0fnu``). Values equal
transformers' ``finegrained_fp8`` dequantization (``Fp8Dequantize``).
"""

from __future__ import annotations

import torch

#: the 16 e2m1 values by nibble (sign bit 3, two exponent bits, one mantissa bit)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
#: scale blocks (rows, columns) of fp8 weights and of 4-bit experts
FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


def ue8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 factors of UE8M0 scales (exponent bytes as ``uint8``, or ``float8_e8m0fnu``);
    other float scales pass as they are."""
    if scales.dtype == torch.uint8:
        return (scales.float() - 127.0).exp2()
    return scales.float()


def is_fp4(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds packed e2m1 pairs (the release stores them as ``int8``)."""
    return weight.dtype == torch.int8 or (_FP4X2 is not None and weight.dtype == _FP4X2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 2K]`` of packed e2m1 pairs ``[..., K]`` (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    pairs = torch.stack((table[(u8 & 0xF).long()], table[(u8 >> 4).long()]), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """``int8 [..., K / 2]`` of e2m1-representable values ``[..., K]`` (inverse of
    `unpack_fp4`; a value off the grid rounds to the nearest grid value)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=values.device)
    codes = (values.float().unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)
    codes = codes.view(*values.shape[:-1], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8)


def dequantize_tensor(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 weight of a quantized one and its scale grid: 4-bit experts in ``1 x 32`` blocks,
    e4m3 in ``128 x 128`` tiles (a partial last tile where the shape is not a multiple)."""
    if is_fp4(weight):
        values, (bm, bn) = unpack_fp4(weight), FP4_BLOCK
    else:
        values, (bm, bn) = weight.float(), FP8_BLOCK
    rows, cols = values.shape[-2:]
    s = ue8m0_to_float(scales)
    if s.shape[-2:] != (-(-rows // bm), -(-cols // bn)):
        raise ValueError(
            f"a weight of {rows} x {cols} needs a scale grid of {-(-rows // bm)} x "
            f"{-(-cols // bn)} ({bm} x {bn} blocks), the checkpoint has {tuple(s.shape)}"
        )
    s = s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return values * s


class Fp4Linear(torch.nn.Module):
    """A bias-free linear layer over packed e2m1 weights ``[out, in / 2]`` (int8) and their
    UE8M0 scales ``[out, in / 32]``, as the release ships the routed experts: the weight stays
    4-bit at rest and is dequantized (`dequantize_tensor`) for each call, in the input's dtype
    (the reference form of a 4-bit GEMM; no fused kernel yet)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features // 2, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale_inv = torch.nn.Parameter(
            torch.empty(out_features, -(-in_features // FP4_BLOCK[1]), dtype=torch.uint8),
            requires_grad=False,
        )

    @classmethod
    def like(cls, linear: torch.nn.Linear) -> Fp4Linear:
        """An `Fp4Linear` of ``linear``'s shape, on its device (meta, for a loader)."""
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_tensor(self.weight, self.weight_scale_inv).to(x.dtype)
        return torch.nn.functional.linear(x, w)
