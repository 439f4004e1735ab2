"""The Gluon sparse MLA kernel on the CPU: it compiles for sm_90, and the dispatch's choice.

Gluon kernels do not run under Triton's CPU interpreter, so CI cannot run this one (the GPU
tests do: ``tests/gpu/test_sparse_mla_gluon_gpu.py``). What CI can check is that it still
compiles for Hopper as a launch would build it, within an SM's shared memory and without
spills, and that ptxas does not serialise its wgmma instructions (its C7515 note: a dot left
in flight across the loop's back edge once made every step wait on every dot).
"""

from __future__ import annotations

import os

# (as every kernel test file: the other Triton kernels of the suite run interpreted; the
# Gluon kernel's compile below runs in a process of its own without it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")

from gluon_sm90 import SM90_SMEM, compile_sm90, spilled_bytes  # noqa: E402
from hisparse.attention import dispatch  # noqa: E402
from hisparse.attention import sparse_mla_gluon as smg  # noqa: E402

#: Compiles the kernel for sm_90 as a decode launch specialises it (16-aligned pointers,
#: strides and sizes).
_COMPILE = """
from hisparse.attention import sparse_mla_gluon as smg

fn = smg._sparse_mla_gluon_kernel
ptrs = dict(q_lat_ptr="*bf16", q_rope_ptr="*bf16", lat_ptr="*i32", sc_ptr="*fp32",
            rp_ptr="*bf16", idx_ptr="*i32", out_ptr="*fp32", lse_ptr="*fp32")
consts = dict(block_size=64, BN=smg.BLOCK_N)
sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "sm_scale_log2" else "i32")
       for a in fn.arg_names}
odd = {"sm_scale_log2", "s_l_h", "s_l_s", "block_size", "BN"}
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in odd}
options = dict(num_warps=smg.NUM_WARPS, maxnreg=smg.MAX_REGS)
"""


def test_gluon_kernel_compiles_for_sm90_without_serialised_wgmma(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared, info, ptx = compile_sm90(_COMPILE, tmp_path)
    assert shared <= SM90_SMEM
    assert "C7515" not in info, info  # "wgmma.mma_async instructions are serialized"
    assert "C7512" not in info, info  # serialised for want of registers (a partition's budget)
    assert "C7507" not in info, info  # a partition's register budget ignored
    # the warp-specialize dispatch saves the shared-memory base once (4 bytes); the partitions'
    # loops spilling their tiles or accumulators would be hundreds
    assert spilled_bytes(info) <= 16, info
    assert "wgmma.mma_async" in ptx


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


def test_diagnostic_versions_still_apply(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`benchmarks/gluon_mla_diagnostics.py` edits the kernel's source by text; a kernel change
    that breaks its anchors should fail here rather than on the GPU machine."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gluon_mla_diagnostics.py")
    spec = importlib.util.spec_from_file_location("gluon_mla_diagnostics", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    paths = mod.write_variants(str(tmp_path))
    from pathlib import Path

    src = Path(smg.__file__).read_text()
    for p in paths:
        text = Path(p).read_text()
        assert text != src and "_sparse_mla_gluon_kernel" in text
        compile(text, p, "exec")  # still Python
