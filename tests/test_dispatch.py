"""Where a kernel is meant to run, it runs (CPU: the Triton kernels under the interpreter, the
CPU backend's data-plane ops).

Every dispatch point hands inputs it does not take, and machines without the kernel, to the
reference, silently: a dispatch edited to call the reference, a `supports()` that stopped
matching or an ImportError swallowed would leave every comparison of kernel and reference
green. Here each dispatch point runs with its reference made to raise wherever it is bound
(`forbid_reference`, conftest), on inputs its kernel takes, and its result is checked against
the reference's, computed before the reference was forbidden. The engine-level form: a CPU
engine's decode runs the CPU backend's ops, never the reference's.

``TRITON_INTERPRET=1`` is set before Triton is imported (it affects only Triton on CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.attention import dispatch
from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
from hisparse.attention.sparse_gqa_reference import GqaRowFormat
from hisparse.engine import decode_inputs as di
from hisparse.kv.row_formats import pack_mla_rows
from hisparse.runtime import ops as ops_pkg
from hisparse.runtime.ops import reference as ref
from hisparse.testing import gqa_indexer_cases as gcases
from hisparse.testing import indexer_cases as icases
from hisparse.testing.ops_cases import (
    compare,
    make_invalidate_case,
    make_resolve_case,
    next_step_topk,
    random_paged_view,
)

pytest.importorskip("triton")

from hisparse.runtime.ops.triton_common import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)

#: The data-plane ops the CPU backend implements itself (its resident_rows and scatter_rows
#: are the reference's by design: one torch op each).
CPU_OWN_OPS = (
    "resolve_residency",
    "gather_compact",
    "gather_compact_group",
    "gather_plan",
    "invalidate_written_slots",
)


# --- attention and indexers (attention/dispatch.py), Triton forced as on CUDA ----------------


def test_sparse_mla_runs_the_triton_kernel(monkeypatch, forbid_reference) -> None:
    g = torch.Generator().manual_seed(1)
    latent, rope, nb, bs = 512, 64, 4, 8
    rows = pack_mla_rows(
        "bf16", torch.randn(nb * bs, latent, generator=g), torch.randn(nb * bs, rope, generator=g)
    )
    kv = rows.view(nb, bs, -1)
    ql, qr = torch.randn(2, 4, latent, generator=g), torch.randn(2, 4, rope, generator=g)
    idx = torch.randint(0, nb * bs, (2, 16), generator=g, dtype=torch.int32)
    idx[0, ::3] = -1
    scale = 192**-0.5
    want = dispatch.sparse_mla_decode_reference(ql, qr, kv, idx, scale, "bf16")
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    forbid_reference(dispatch.sparse_mla_decode_reference)
    out, lse = dispatch.sparse_mla_decode(ql, qr, kv, idx, scale, "bf16")
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("need_lse", [True, False])
def test_sparse_gqa_runs_the_triton_kernel(monkeypatch, forbid_reference, need_lse) -> None:
    g = torch.Generator().manual_seed(2)
    fmt, nb, bs = GqaRowFormat(3, 64, "bf16"), 4, 8
    k = torch.randn(nb * bs, 3, 64, generator=g)
    kv = fmt.pack(k, torch.randn(nb * bs, 3, 64, generator=g)).view(nb, bs, -1)
    q = torch.randn(2, 9, 64, generator=g)
    idx = torch.randperm(nb * bs, generator=g)[:20].repeat(2, 1).to(torch.int32)
    idx[1, ::4] = -1
    want = dispatch.sparse_gqa_reference(q, kv, idx, 0.125, fmt)
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    forbid_reference(dispatch.sparse_gqa_reference, dispatch._sdpa_decode_cpu)
    out, lse = dispatch.sparse_gqa_decode(q, kv, idx, 0.125, fmt, need_lse=need_lse)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["exact", "fp8"])
def test_lightning_indexer_runs_the_triton_kernel(monkeypatch, forbid_reference, kind) -> None:
    case = icases.random_indexer_case(
        kind, [30, 12], [2, 1], heads=16, head_dim=64, block_size=8, device="cpu", seed=70
    )
    args = (*case.args(), case.seq_lens, 8, case.softmax_scale)
    monkeypatch.setenv("HISPARSE_INDEXER", "triton")
    forbid_reference(dispatch.indexer_topk_paged_reference)
    got = dispatch.indexer_topk_paged(*args)
    scores = icases.reference_scores(case, 32)
    tol = icases.score_tolerance(scores, 1e-5, 1e-6)
    assert icases.selection_errors(got, scores, case.limits, 8, tol) == []


def test_gqa_indexer_runs_the_triton_kernels(monkeypatch, forbid_reference) -> None:
    cfg, scale, width = GqaIndexerConfig(top_k=24, sink_tokens=2, recent_window=8), 0.25, 24
    case = gcases.random_decode_case([40, 30], head_dim=16, block_size=8, seed=5)
    want = dispatch.gqa_indexer_topk_decode(*case.args(), cfg, scale, width)  # CPU: reference
    monkeypatch.setenv("HISPARSE_GQA_INDEXER", "triton")
    forbid_reference(dispatch.gqa_indexer_topk_decode_reference)
    got = dispatch.gqa_indexer_topk_decode(*case.args(), cfg, scale, width)
    scores = gcases.reference_scores(case, cfg, scale)
    assert gcases.selection_errors(got, want, case, cfg, scores, 1e-5, 1e-6) == []


# --- the decode step's inputs (engine/decode_inputs.py), HISPARSE_FUSED=triton ---------------


def test_decode_inputs_run_the_triton_kernels(monkeypatch, forbid_reference) -> None:
    g = torch.Generator().manual_seed(3)
    b, slots, bs, mb = 5, 9, 16, 6
    table = torch.randint(0, 90, (2, slots + 1, mb), generator=g, dtype=torch.int32)
    pos = torch.randint(0, mb * bs, (b,), generator=g)
    slot = torch.randperm(slots, generator=g)[:b]
    slot[1] = -1
    hm = torch.randint(0, 50, (2, b + 1, 2), generator=g, dtype=torch.int32)
    row_bytes = torch.tensor([656, 144])
    want = di.decode_inputs_reference(pos, slot, table, bs, slots)
    want_counts = di.step_counts_reference(hm, b, row_bytes)
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    forbid_reference(di.decode_inputs_reference, di.step_counts_reference)
    got = di.decode_inputs(pos, slot, table, bs, slots)
    for name in want.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(di.step_counts(hm, b, row_bytes), want_counts)


# --- the data-plane ops (runtime/ops): the CPU backend by default, Triton when forced ---------


def _all_ops(ops) -> dict[str, object]:
    """Each data-plane op of ``ops`` on fresh inputs (a resolve over three steps, then the
    gathers of its swap lists, a plan copy, an invalidation): every output and state."""
    case = make_resolve_case(Q=3, K=8, H=24, block_size=4, seed=11, max_rows=2, hot_fill=0.5)
    out = {}
    for step in range(3):
        if step:
            case.topk = next_step_topk(case, step)
        ops.resolve_residency(*case.args())
        out.update({f"{k}@{step}": v.clone() for k, v in case.state_and_outputs().items()})
    g = torch.Generator().manual_seed(12)
    host = random_paged_view(int(case.source_block_table.max()) + 1, 4, 48, 64, g)
    nd = int(case.hot_block_table.max()) + 1
    dev = random_paged_view(nd, 4, 48, 48, g)
    ops.gather_compact(host, dev, case.swap_src, case.swap_dst, case.swap_count)
    span = random_paged_view(int(case.source_block_table.max()) + 1, 4, 96, 96, g)
    pool = torch.zeros(nd, 2, 4, 48, dtype=torch.uint8)
    ops.gather_compact_group(span, [pool[:, 0], pool[:, 1]], case.swap_src, case.swap_dst,
                             case.swap_count)  # fmt: skip
    plan = random_paged_view(30, 2, 48, 48, g)
    src_rows = torch.randint(0, 40, (9,), generator=g, dtype=torch.int32)
    dst_rows = torch.randperm(60, generator=g)[:9].to(torch.int32)
    ops.gather_plan(host, plan, src_rows, dst_rows, (src_rows % 3 > 0).to(torch.int32))
    hot, state, row_req, written = make_invalidate_case(81)
    ops.invalidate_written_slots(hot, state, row_req, written)
    out.update(dev=dev, pool=pool, plan=plan, hot=hot)
    return out


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_data_plane_ops_run_the_backend(monkeypatch, forbid_reference, backend) -> None:
    """``ops_for("cpu")`` with ``HISPARSE_OPS`` unset is the CPU backend; ``triton`` the
    Triton kernels: neither hands a valid call to the reference."""
    monkeypatch.delenv("HISPARSE_OPS", raising=False)
    want = _all_ops(ref)
    if backend == "triton":
        monkeypatch.setenv("HISPARSE_OPS", "triton")
    ops = ops_pkg.ops_for("cpu")
    assert ops is not ref
    forbid_reference(*(getattr(ref, name) for name in CPU_OWN_OPS))
    got = _all_ops(ops)
    assert not compare(want, got)


def test_cpu_engine_decode_runs_the_cpu_backend(forbid_reference, tiny_checkpoint) -> None:
    """A HiSparse engine on the CPU (``offload="always"``: every decode step resolves, gathers
    and invalidates) runs the CPU backend's ops, not the reference's, with the default
    environment."""
    from hisparse.engine.llm import LLM
    from hisparse.engine.sampling import SamplingParams

    for var in ("HISPARSE_OPS", "HISPARSE_CPU_JIT", "HISPARSE_CPU_FAST"):
        assert var not in os.environ, var
    path = tiny_checkpoint("deepseek_v32")
    forbid_reference(*(getattr(ref, name) for name in CPU_OWN_OPS))
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, offload="always")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23)]
    with LLM(path, hisparse=cfg, kv_format="bf16", max_model_len=96, max_num_seqs=2,
             gpu_memory_gib=0.02) as llm:  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=8)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert sum(o.metrics.misses for o in outs) > 0  # the swap path ran
