"""fp8 linear layers: e4m3 weights with their 128 x 128 tile scales, W8A8 GEMMs.

`Fp8Linear` keeps a checkpoint's ``weight`` (e4m3) and ``weight_scale_inv`` as they ship and
computes ``x @ W.T`` as W8A8 (`hisparse.models.fp8`: activations quantized per token in groups
of 128, fp32 partial products per K block). One dispatch point, `fp8_gemm`, picks the kernel
for the device (``HISPARSE_FP8_GEMM=auto|reference|triton|scaled_mm``):

* ``scaled_mm``: ``torch._scaled_mm`` with blockwise scales (the 1 x 128 activation / 128 x 128
  weight recipe cuBLAS runs on sm90), where the device is an sm90 GPU, the torch build has it
  and a one-time check on the device agrees with the reference; weights whose widths are not
  whole tiles (or that start inside one) take the Triton kernel. M is padded to a multiple of
  16 rows and the activation scales passed outer-dim-major, as cuBLAS requires.
* ``triton``: `fp8_triton.block_gemm` (CUDA of compute capability 8.9 or more; the CPU under
  ``TRITON_INTERPRET=1``).
* ``reference``: `fp8.w8a8_linear` (the CPU, and GPUs without fp8 tensor cores).

Each kernel is logged once when first chosen; `kernels_used` lists them for reports.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hisparse import envs
from hisparse.models import fp8
from hisparse.models.fp8 import BLOCK, cdiv, scale_rows

log = logging.getLogger(__name__)

GEMM_ENV = "HISPARSE_FP8_GEMM"
#: What each backend is called in logs and ``hisparse generate``'s report.
KERNEL_NAMES = {
    "reference": "W8A8 reference (torch, fp32 per K block)",
    "triton": "Triton block-fp8 GEMM",
    "scaled_mm": "torch._scaled_mm blockwise (1x128 activations, 128x128 weights)",
    "grouped_triton": "Triton grouped block-fp8 GEMM (experts)",
    "grouped_reference": "W8A8 reference per expert",
}
#: rows of the activation matrix ``torch._scaled_mm`` gets (padded up to a multiple)
SCALED_MM_ROW_MULTIPLE = 16
_used: dict[str, None] = {}


def note_kernel(name: str) -> None:
    """Record (and log, the first time) that kernel ``name`` of `KERNEL_NAMES` runs."""
    if name not in _used:
        _used[name] = None
        log.info("fp8: %s", KERNEL_NAMES[name])


def kernels_used() -> list[str]:
    """The fp8 kernels this process has chosen so far, by `KERNEL_NAMES` description."""
    return [KERNEL_NAMES[n] for n in _used]


def triton_fp8_ok(device: torch.device) -> bool:
    """Whether Triton's fp8 dot runs on ``device``: CUDA of capability 8.9 or more, or the
    CPU in Triton's interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    from hisparse.runtime.ops.triton_common import interpreting

    return interpreting()


def gemm_backend(device: torch.device) -> str:
    """The fp8 GEMM for tensors on ``device`` (module docstring)."""
    choice = envs.value(GEMM_ENV)
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "reference"
    if scaled_mm_ok(device):
        return "scaled_mm"
    return "triton" if triton_fp8_ok(device) else "reference"


def prepare(device: torch.device) -> str:
    """Decide (and check, on sm90) the GEMM for ``device`` before any CUDA graph is captured
    (the check reads a result on the host); returns the backend."""
    backend = gemm_backend(device)
    note_kernel(backend)
    return backend


@functools.cache
def _scaled_mm_check(index: int) -> bool:
    device = torch.device("cuda", index)
    if torch.cuda.get_device_capability(device) != (9, 0) or not hasattr(torch, "_scaled_mm"):
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 512, generator=g).to(device, torch.bfloat16)
    qw, sw = fp8.quantize_weight(torch.randn(256, 512, generator=g))
    qw, sw = qw.to(device), sw.to(device)
    qx, sx = fp8.act_quant(x)
    try:
        got = _scaled_mm(qx, sx, qw, sw, torch.bfloat16).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        log.info("fp8: torch._scaled_mm blockwise unavailable here (%s)", err)
        return False
    want = fp8.block_gemm(qx, sx, qw, sw)
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err <= 1e-2:
        log.warning("fp8: torch._scaled_mm blockwise disagrees with W8A8 (%.3g); not used", err)
        return False
    return True


def scaled_mm_ok(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs the blockwise recipe on ``device`` and agrees with
    the reference (checked once per device)."""
    if device.type != "cuda":
        return False
    return _scaled_mm_check(device.index if device.index is not None else 0)


def _scaled_mm(
    qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """cuBLAS's blockwise fp8 GEMM: rows padded to `SCALED_MM_ROW_MULTIPLE`, activation scales
    ``[M, Kt]`` outer-dim-major, weight scales ``[Kt, Nt]`` as a transposed view."""
    m = qx.shape[0]
    mp = cdiv(max(m, 1), SCALED_MM_ROW_MULTIPLE) * SCALED_MM_ROW_MULTIPLE
    if mp != m:
        qx = F.pad(qx.view(torch.uint8), (0, 0, 0, mp - m)).view(torch.float8_e4m3fn)
        sx = F.pad(sx, (0, 0, 0, mp - m), value=1.0)
    scale_a = sx.t().contiguous().t()
    out = torch._scaled_mm(qx, qw.t(), scale_a=scale_a, scale_b=sw.t(), out_dtype=out_dtype)
    return out[:m]


def _scaled_mm_shape(qw: torch.Tensor, row_offset: int) -> bool:
    n, k = qw.shape
    return row_offset == 0 and n % BLOCK == 0 and k % BLOCK == 0 and (k // BLOCK) % 4 == 0


def fp8_gemm(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    *,
    pow2: bool = False,
    row_offset: int = 0,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` in x's dtype, W8A8 (`fp8.w8a8_linear`), on the device's kernel."""
    backend = gemm_backend(x.device)
    if backend == "reference":
        note_kernel("reference")
        return fp8.w8a8_linear(x, qw, sw, pow2=pow2, row_offset=row_offset)
    from hisparse.models import fp8_triton

    if x.stride(-1) != 1:
        x = x.contiguous()
    qx, sx = fp8_triton.act_quant(x, pow2)
    if backend == "scaled_mm" and _scaled_mm_shape(qw, row_offset) and x.dtype != torch.float16:
        note_kernel("scaled_mm")
        return _scaled_mm(qx, sx, qw, sw, x.dtype)
    note_kernel("triton")
    return fp8_triton.block_gemm(qx, sx, qw, sw, row_offset, out_dtype=x.dtype)


class Fp8Linear(nn.Module):
    """A bias-free (or biased) linear layer over an e4m3 ``weight [out, in]`` and its fp32
    ``weight_scale_inv [ceil((row_offset + out) / 128), ceil(in / 128)]``: the checkpoint's
    tensors under the checkpoint's names. ``row_offset``: where a tensor-parallel rank's rows
    start inside their first scale tile. ``pow2``: power-of-two activation scales (ue8m0)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        row_offset: int = 0,
        pow2: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.row_offset, self.pow2 = row_offset, pow2
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=fp8.FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_rows(out_features, row_offset), cdiv(in_features, BLOCK)),
            requires_grad=False,
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, pow2: bool) -> Fp8Linear:
        """An `Fp8Linear` of ``linear``'s shape, on its device (meta, for a loader)."""
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, pow2=pow2)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"row_offset={self.row_offset}, pow2={self.pow2}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = fp8_gemm(
            x.reshape(-1, x.shape[-1]),
            self.weight,
            self.weight_scale_inv,
            pow2=self.pow2,
            row_offset=self.row_offset,
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)
