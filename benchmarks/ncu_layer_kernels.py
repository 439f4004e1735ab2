"""One DSA decode layer's three largest kernels at 29 x 128K, once each, for Nsight Compute.

At 29 requests of 128K the score kernel, the top-k select and the sparse MLA kernel take most
of a decode step's GPU time (docs/benchmarks.md §4). This script launches each once on fresh
random inputs (DeepSeek-V3.2 shapes: 64 indexer heads x 128, top_k 2048; 128 MLA heads,
fp8_ds_mla rows) so that ``ncu`` can read their counters (stall reasons, occupancy, issue and
memory throughput):

    ncu --clock-control none \\
        -k regex:'_indexer_scores|_hist_kernel|_sparse_mla_wide|_sparse_mla_gluon' \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_layer_kernels.py
"""

from __future__ import annotations

import argparse

import torch

from hisparse.attention import indexer_triton as it
from hisparse.attention import sparse_mla_triton as smt
from hisparse.attention.topk_triton import topk_select_triton
from hisparse.kv.row_formats import mla_row_bytes
from hisparse.testing import indexer_cases as ic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=29)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--mla-only", action="store_true", help="the sparse MLA kernels alone")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t, s = args.batch, args.context
    case = ic.random_indexer_case(
        "fp8", [s] * t, [1] * t, heads=64, head_dim=128, block_size=64, device=dev, seed=0
    )
    if args.mla_only:  # random picks in place of the indexer's
        picks = torch.randint(0, s, (t, 2048), device=dev, dtype=torch.int32)
    else:
        scores = it.indexer_scores_paged_triton(*case.args(), case.softmax_scale)
        picks = topk_select_triton(scores, 2048, positions=case.positions, req_index=case.req_index)
    # MLA rows: random bytes, with finite scales and RoPE (fp8_ds_mla layout)
    rb = mla_row_bytes("fp8_ds_mla", 512, 64)
    pool = torch.randint(0, 120, (t * s // 64, 64, rb), dtype=torch.uint8, device=dev)
    flat = pool.view(-1, rb)
    flat[:, 512:528].view(torch.float32).fill_(0.01)
    flat[:, 528:].view(torch.bfloat16).normal_()
    g = torch.Generator(device=dev).manual_seed(1)
    ql = torch.randn(t, 128, 512, generator=g, device=dev).bfloat16()
    qr = torch.randn(t, 128, 64, generator=g, device=dev).bfloat16()
    rows = picks + (torch.arange(t, device=dev, dtype=torch.int32) * s)[:, None]
    out, _ = smt.sparse_mla_decode_triton(ql, qr, pool, rows, 0.1, "fp8_ds_mla")
    from hisparse.attention import sparse_mla_gluon as smg

    if smg.supported(dev):  # the Gluon kernel on the same rows
        out_g, _ = smg.sparse_mla_decode_gluon(ql, qr, pool, rows, 0.1)
        print("gluon vs triton max abs diff", float((out_g.float() - out.float()).abs().max()))
    torch.cuda.synchronize()
    print("ok", float(out.float().abs().mean()))


if __name__ == "__main__":
    main()
