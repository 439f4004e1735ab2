"""The Gluon sparse MLA kernel on the CPU: it compiles for sm_90, and the dispatch's choice.

Gluon kernels do not run under Triton's CPU interpreter, so CI cannot run this one (the GPU
tests do: ``tests/gpu/test_sparse_mla_gluon_gpu.py``). What CI can check is that it still
compiles for Hopper as a launch would build it, within an SM's shared memory and without
spills, and that ptxas does not serialise its wgmma instructions (its C7515 note: a dot left
in flight across the loop's back edge once made every step wait on every dot).
"""

from __future__ import annotations

import os
import subprocess

# (as every kernel test file: the other Triton kernels of the suite run interpreted; the
# Gluon kernel's compile below does not depend on it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")

from hisparse.attention import dispatch  # noqa: E402
from hisparse.attention import sparse_mla_gluon as smg  # noqa: E402

#: Dynamic shared memory one block may use on sm_90.
SM90_SMEM = 232448


def _compile_sm90():  # type: ignore[no-untyped-def]
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = smg._sparse_mla_gluon_kernel
    ptrs = dict(q_lat_ptr="*bf16", q_rope_ptr="*bf16", lat_ptr="*fp8e4nv", sc_ptr="*fp32",
                rp_ptr="*bf16", idx_ptr="*i32", out_ptr="*fp32", lse_ptr="*fp32")  # fmt: skip
    consts = dict(block_size=64, BN=smg.BLOCK_N)
    sig = {
        a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "sm_scale_log2" else "i32")
        for a in fn.arg_names
    }
    # what a decode launch specialises: 16-aligned pointers, strides and sizes
    odd = {"sm_scale_log2", "s_l_h", "s_l_s", "block_size", "BN"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in odd}
    src = GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=smg.NUM_WARPS)
    )


def test_gluon_kernel_compiles_for_sm90_without_serialised_wgmma(tmp_path) -> None:  # type: ignore[no-untyped-def]
    try:
        kernel = _compile_sm90()
    except RuntimeError as exc:  # pragma: no cover - a Triton build without the NVIDIA backend
        pytest.skip(f"no sm_90 compiler here: {exc}")
    assert kernel.metadata.shared <= SM90_SMEM
    ptx = tmp_path / "k.ptx"
    ptx.write_text(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    if not os.path.exists(ptxas):  # pragma: no cover
        pytest.skip("no ptxas in this Triton build")
    res = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    info = res.stdout + res.stderr
    assert "C7515" not in info, info  # "wgmma.mma_async instructions are serialized"
    assert "bytes spill" not in info or " 0 bytes spill stores" in info, info
    assert "wgmma.mma_async" in kernel.asm["ptx"]


def test_dispatch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(32, 128, 512, dtype=torch.bfloat16)
    qr = torch.zeros(32, 128, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 656, dtype=torch.uint8)
    monkeypatch.setenv("HISPARSE_MLA_KERNEL", "gluon-please")
    with pytest.raises(ValueError, match="HISPARSE_MLA_KERNEL"):
        dispatch._use_gluon_mla(q, qr, kv, "fp8_ds_mla")
    monkeypatch.setenv("HISPARSE_MLA_KERNEL", "auto")
    assert not dispatch._use_gluon_mla(q, qr, kv, "fp8_ds_mla")  # CPU tensors
    assert not smg.supported(torch.device("cpu"))
