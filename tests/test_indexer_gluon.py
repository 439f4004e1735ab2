"""The Gluon (TMA ring) indexer score kernel on the CPU: it compiles for sm_90, and where the
dispatch takes it. It runs on the GPU in ``tests/gpu/test_indexer_gpu.py``."""

from __future__ import annotations

import os
import re

# (the other Triton kernels of the suite run interpreted; the compile below runs in a process
# of its own without it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from gluon_sm90 import SM90_SMEM, compile_sm90, spilled_bytes
from hisparse.attention import indexer_gluon as ig
from hisparse.kv.row_formats import IndexerCacheFormat

#: Compiles the kernel as a decode launch at DeepSeek-V3.2's sizes specialises it (64 heads,
#: 64-key pages, the committed ring depth; ``GROUP``: with the top-k's group maxima or not).
_COMPILE = """
from triton.experimental.gluon import language as gl
from hisparse.attention import indexer_gluon as ig

fn = ig._indexer_scores_gluon_kernel
keys = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
scales = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
ptrs = dict(key_desc=f"tensordesc<fp8e4nv[1, 64, 128],{keys!r}>",
            scale_desc=f"tensordesc<fp32[1, 64],{scales!r}>", q_ptr="*fp8e4nv", qs_ptr="*fp32",
            w_ptr="*fp32", table_ptr="*i32", req_ptr="*i32", pos_ptr="*i32", out_ptr="*fp32",
            gmax_ptr="*i32", hist_ptr="*i32")
consts = dict(block_size=64, sc_off=2048, HP=64, STAGES=ig.STAGES, GROUP={group})
sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "softmax_scale" else "i32")
       for a in fn.arg_names}
aligned = {"chunk", "num_cols", "s_q_t", "s_q_h", "s_qs_t", "s_w_t", "s_tab_r", "s_out_t",
           "s_g_t", "s_h_t"}
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
         if a in aligned or ptrs.get(a, "").startswith("*")}
options = dict(num_warps=ig.NUM_WARPS)
"""


@pytest.mark.parametrize("group", [0, 16])
def test_kernel_compiles_for_sm90_in_its_programs_per_sm(tmp_path, group: int) -> None:  # type: ignore[no-untyped-def]
    shared, info, ptx = compile_sm90(_COMPILE.replace("{group}", str(group)), tmp_path)
    # `PROGRAMS_PER_SM` programs fit an SM's shared memory (228 KB, 1 KB reserved a block)
    assert ig.PROGRAMS_PER_SM * (shared + 1024) <= 233472, shared
    assert shared <= SM90_SMEM
    assert spilled_bytes(info) == 0, info
    regs = max(int(n) for n in re.findall(r"Used (\d+) registers", info))
    assert ig.PROGRAMS_PER_SM * ig.NUM_WARPS * 32 * regs <= 65536, info
    assert "cp.async.bulk.tensor.3d" in ptx and "wgmma.mma_async" in ptx
    assert ("atom.global" in ptx) == bool(group)  # the maxima's histogram, added to the row's


def test_dispatch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = IndexerCacheFormat("fp8", 128)
    q = torch.zeros(2, 64, 128, dtype=torch.float8_e4m3fn)
    qs = torch.ones(2, 64, 1)
    pages = torch.zeros(4, 64 * fmt.row_bytes, dtype=torch.uint8)
    assert not ig.usable(q, qs, pages, fmt, True)  # CPU tensors
    monkeypatch.setenv("HISPARSE_INDEXER_KERNEL", "gluon-please")
    with pytest.raises(ValueError, match="HISPARSE_INDEXER_KERNEL"):
        ig.usable(q, qs, pages, fmt, True)
