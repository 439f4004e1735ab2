"""The engine end to end on tiny DSA checkpoints written by transformers (CPU).

Lossless: ``kv_placement="hisparse"`` gives the same greedy tokens as ``"gpu"`` — with prompts
longer than top_k, with the hot buffer at its minimum, with a GPU pool tight enough to force
preemption with recompute, and with a host pool so small that requests must wait. The default
offload policy (``"under_pressure"``) unless a test exercises the swap path: those ask for
``offload="always"`` (every request reads its older rows through its hot buffer).
"""

from __future__ import annotations

import os

# Triton kernels on CPU tensors (one test below) need the interpreter set before Triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.bench.hooks import BenchHooks
from hisparse.config import HiSparseConfigError
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


#: `HiSparseConfig` keywords of the tests that exercise the swap path (`_run`'s ``**hs``).
ALWAYS = {"offload": "always"}


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def requests_pool(requests: float):
    """A GPU pool size (blocks, the null block included) holding ``requests`` requests of
    max_model_len tokens at their peak: tight pools in the layout's own unit, whatever block
    size the planner picks."""
    return lambda lay: 1 + int(requests * lay.gpu_blocks_per_request(lay.max_model_len))


def _prompts(lengths=(40, 23, 70, 33), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _run(
    path,
    placement,
    *,
    blocks=None,
    host_gib=0.01,
    params=GREEDY,
    prompts=None,
    seqs=4,
    llm_kw=None,
    **hs,
):
    cfg = HiSparseConfig(host_pool_gib=host_gib, block_size=4, **hs)
    kw = dict(
        kv_placement=placement,
        hisparse=cfg,
        kv_format="bf16",
        max_model_len=128,
        max_num_seqs=seqs,
        **(llm_kw or {}),
    )
    gib = 0.02
    if blocks is not None:
        with LLM(path, gpu_memory_gib=gib, **kw) as probe:
            lay = probe.kv.layout  # a pool of `blocks` blocks beside the staging area
            n = blocks(lay) if callable(blocks) else blocks
            gib = (n * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    with LLM(path, gpu_memory_gib=gib, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts or _prompts(), sampling_params=params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("offload", [None, "always"], ids=["default", "always"])
def test_hisparse_equals_all_gpu(checkpoint, offload):
    gpu = _run(checkpoint, "gpu")
    hs = _run(checkpoint, "hisparse", offload=offload)
    assert _tokens(hs) == _tokens(gpu)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in gpu)
    if offload == "always":
        # the hot buffers really were used: misses were swapped in, hits served
        assert sum(o.metrics.misses for o in hs) > 0 and sum(o.metrics.hits for o in hs) > 0


def test_lossless_with_lazy_host_mirror(checkpoint):
    """Decode rows reach the host only when their page leaves the GPU (`write_back`)."""
    gpu = _run(checkpoint, "gpu")
    hs = _run(checkpoint, "hisparse", eager_host_mirror=False, **ALWAYS)
    assert _tokens(hs) == _tokens(gpu)


def test_lazy_mirror_writes_back_decode_pages_only(checkpoint):
    """A chunked prefill mirrors its rows itself: its trimmed pages are not copied again; the
    pages decode rows reach only on the GPU are, once each, when they leave the tail."""
    prompts = _prompts((70, 41))
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, eager_host_mirror=False, **ALWAYS)
    # (without the prefix cache, which writes back the full pages it keeps at a request's end:
    # tests/test_prefix_cache.py covers that)
    kw = dict(hisparse=cfg, kv_format="bf16", max_model_len=128, max_num_seqs=4,
              gpu_memory_gib=0.02, max_num_batched_tokens=16,
              enable_prefix_caching=False)  # fmt: skip
    for max_tokens, want in ((2, 0), (30, None)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        with LLM(checkpoint, **kw) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            written = llm.runner.pages_written_back
            groups = len(llm.kv.resident_groups)
        ref = _run(checkpoint, "gpu", params=params, prompts=prompts)
        assert _tokens(outs) == _tokens(ref)
        if want is not None:
            assert written == want  # prefill pages trimmed chunk after chunk, none copied
        else:
            # every page holding a decode row that left the two-page tail, once per group
            bs = 4
            dropped = [
                set(range(len(p) // bs, (len(p) + max_tokens - 1) // bs + 1))
                & set(range(max(-(-(len(p) + max_tokens - 1) // bs) - 2, 0)))
                for p in prompts
            ]
            assert written == groups * sum(len(d) for d in dropped) > 0


def test_lossless_at_minimum_hot_buffer(checkpoint):
    gpu = _run(checkpoint, "gpu")
    top_k = 16  # the tiny preset's index_topk
    hs = _run(checkpoint, "hisparse", device_buffer_size=top_k, **ALWAYS)
    assert _tokens(hs) == _tokens(gpu)


def test_lossless_under_preemption_and_a_tiny_host_pool(checkpoint):
    long = SamplingParams(temperature=0, max_tokens=90)
    prompts = _prompts((20, 23, 30, 33))
    # GPU pool tight enough that decoding requests outgrow it: one is preempted and recomputed
    # (the default policy's demotions before it: test_offload_under_pressure.py)
    tight = _run(checkpoint, "hisparse", blocks=requests_pool(1.9), top_k=4, params=long,
                 prompts=prompts, **ALWAYS)  # fmt: skip
    assert sum(o.metrics.preemptions for o in tight) > 0
    for o in tight:  # recorded at the first preemption only
        n = o.metrics.tokens_before_first_preemption
        assert (n is not None) == (o.metrics.preemptions > 0)
        assert n is None or 0 <= n < long.max_tokens
    ref4 = _run(checkpoint, "gpu", params=long, prompts=prompts, top_k=4)
    assert _tokens(tight) == _tokens(ref4)
    # The all-GPU engine preempts too when its pool is tight, and finishes every request.
    # (Its tokens are not compared with the unpreempted run: a recomputed prefill produces
    # the KV rows in one batched matmul instead of token by token, which may round
    # differently; losslessness is about placement, compared under the same schedule.)
    gpu_tight = _run(checkpoint, "gpu", blocks=60, params=long, prompts=prompts)
    assert sum(o.metrics.preemptions for o in gpu_tight) > 0
    assert all(len(o.token_ids) == long.max_tokens for o in gpu_tight)
    # A host pool of 39 usable blocks (40 of 5,696 B: rows plus the prefix cache's copy of the
    # page's indexer keys) holds one of these requests (29-32 blocks reserved for prompt + 90
    # new tokens) at a time: the others wait, nothing overflows. Same schedule as an all-GPU
    # engine running one request at a time.
    small = _run(checkpoint, "hisparse", host_gib=0.000213, params=long, prompts=prompts)
    one_at_a_time = _run(checkpoint, "gpu", params=long, prompts=prompts, seqs=1)
    assert _tokens(small) == _tokens(one_at_a_time)


def test_prompts_that_can_never_run_raise_before_anything_runs(checkpoint):
    """vLLM's behaviour: empty, too long for max_model_len, or ids outside the vocabulary
    is a `ValueError` naming the prompt and the fix; the good prompt then runs."""
    good = _prompts((30,))[0]
    with LLM(
        checkpoint,
        hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
        kv_format="bf16",
        max_model_len=128,
        gpu_memory_gib=0.02,
    ) as llm:
        for i, (bad, needle) in enumerate([([], "empty"), (list(range(200)), "max_model_len=128"),
                                           ([7, 600], "outside the vocabulary")]):  # fmt: skip
            prompts = [good, good, good]
            prompts[i] = bad
            with pytest.raises(ValueError, match=f"prompt {i} \\(of 3\\): .*{needle}"):
                llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        with pytest.raises(ValueError, match="room for at most 127 and one of output: shorten"):
            llm.generate(prompt_token_ids=list(range(200)), sampling_params=GREEDY)
        assert not llm.scheduler.waiting and not llm.kv.requests
        (out,) = llm.generate(prompt_token_ids=[good], sampling_params=GREEDY)
    assert out.ok and len(out.token_ids) == GREEDY.max_tokens


def test_host_pool_too_small_for_one_request_fails_at_start(checkpoint):
    """Admission counts every token a request may hold, capped at max_model_len, so a pool
    below one max_model_len request is refused when the engine starts, with the fix named."""
    with pytest.raises(HiSparseConfigError, match=r"Set host_pool_gib >= 0\.01 GiB"):
        LLM(
            checkpoint,
            hisparse=HiSparseConfig(host_pool_gib=0.0001, block_size=4),
            kv_format="bf16",
            max_model_len=128,
            gpu_memory_gib=0.02,
        )


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"LLM.model '.*nope': no such file or folder"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"this folder has no config\.json"):
        LLM(tmp_path)


def test_seeded_sampling_is_reproducible(checkpoint):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=3)
    a = _run(checkpoint, "hisparse", params=params)
    b = _run(checkpoint, "gpu", params=params)
    assert _tokens(a) == _tokens(b)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_persistent_block_tables_follow_every_block_change():
    """The device tables by slot equal tables rebuilt from the block lists after admission,
    prefill growth, decode growth, tail trimming and freeing (slot reuse included)."""
    from hisparse.engine.kv_manager import KVCacheManager
    from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat

    specs = []
    for i in range(2):
        name = f"layers.{i}.attn"
        specs.append(LayerCacheSpec(name, CacheKind.SPARSE, 64, 4, RowFormat.BF16_MLA, name))
        specs.append(LayerCacheSpec(f"layers.{i}.indexer", CacheKind.INDEXER, 32, 4))
    cfg = HiSparseConfig(top_k=4, host_pool_gib=0.001, block_size=4).resolve()
    for placement in ("hisparse", "gpu"):
        kv = KVCacheManager(
            specs,
            cfg,
            placement=placement,
            gpu_budget_bytes=2**20,
            max_model_len=64,
            max_num_seqs=3,
            device=torch.device("cpu"),
        )

        def check(ids, kv=kv):
            kv.flush_table_updates()  # what the runner applies before a step
            slots = torch.tensor([kv.requests[r].slot for r in ids])
            host, idx, res = kv.step_tables(slots)
            if kv.hisparse:
                assert torch.equal(host, kv.block_table(ids, "host"))
            assert torch.equal(idx, kv.block_table(ids, "indexer"))
            for gi, t in enumerate(res):
                assert torch.equal(t, kv.block_table(ids, "resident", gi))

        for rid, n in (("a", 13), ("b", 30), ("c", 5)):
            kv.admit(rid, 60)
            kv.lease_hot(rid)
            kv.grow(rid, n, keep_all_resident=True)
        check(["a", "b", "c"])
        for step in range(9):  # decode: new tail pages, old pages dropped
            for rid in ("a", "b", "c"):
                n = {"a": 13, "b": 30, "c": 5}[rid] + step + 1
                kv.grow(rid, n, keep_all_resident=False)
                kv.release_resident(rid, kv.trim_resident(rid, n))
            check(["c", "a", "b"])
        kv.free("b")
        kv.admit("d", 40)
        kv.lease_hot("d")  # takes b's slot: its rows must not leak
        kv.grow("d", 9, keep_all_resident=True)
        check(["d", "a"])
        kv.close()


def test_indexer_pages_are_sub_blocks_of_shared_blocks():
    """With m indexer pages per block (the tiny checkpoints' shapes plan m > 1), a request's
    indexer page p is page p % m of its block p // m: cdiv(pages, m) blocks, ids b * m + i
    no other request or group holds, every block back in the pool when it is freed, and
    never more blocks than the plan's need."""
    from hisparse.engine.kv_manager import KVCacheManager
    from hisparse.kv.cache_shapes import dsa_cache_specs

    specs = dsa_cache_specs(
        [True] * 4, block_size=4, kv_format="bf16", kv_lora_rank=128, rope_dim=16,
        index_head_dim=64,
    )  # fmt: skip
    # offload="always": a request holds its tail pages only (what gpu_need counts)
    cfg = HiSparseConfig(top_k=4, host_pool_gib=0.001, block_size=4, offload="always").resolve()
    kv = KVCacheManager(
        specs, cfg, placement="hisparse", gpu_budget_bytes=2**20, max_model_len=128,
        max_num_seqs=2, device=torch.device("cpu"),
    )  # fmt: skip
    m = kv.layout.indexer_pages_per_block
    assert m > 1
    free0 = kv.gpu_blocks.num_free
    for rid in ("a", "b"):
        kv.admit(rid, 128)
        kv.lease_hot(rid)
    for n in range(1, 120):  # both grow token by token, interleaved, as decodes do
        for rid in ("a", "b"):
            kv.grow(rid, n)
            assert kv.gpu_held(rid) <= kv.gpu_need(n)
            kv.release_resident(rid, kv.trim_resident(rid, n))
            b = kv.requests[rid]
            pages = -(-n // 4)
            assert len(b.indexer) == pages and len(b.indexer_blocks) == -(-pages // m)
            assert b.indexer == [b.indexer_blocks[p // m] * m + p % m for p in range(pages)]
    a, b = kv.requests["a"], kv.requests["b"]
    others = {blk for r in (a, b) for res in r.resident for blk in res.values()}
    others |= {blk for r in (a, b) for region in r.hot for blk in region}
    assert not (set(a.indexer_blocks) | set(b.indexer_blocks)) & others
    assert not set(a.indexer_blocks) & set(b.indexer_blocks)
    assert min(a.indexer + b.indexer) >= m  # block 0 (sub-ids 0 .. m-1) stays null
    pages_view = kv.gpu_pages("layers.0.indexer")
    assert max(a.indexer + b.indexer) < pages_view.shape[0] == kv.layout.gpu_num_blocks * m
    slots = torch.tensor([a.slot, b.slot])
    kv.flush_table_updates()
    assert torch.equal(kv.step_tables(slots)[1], kv.block_table(["a", "b"], "indexer"))
    kv.free("a")
    kv.free("b")
    assert kv.gpu_blocks.num_free == free0
    kv.close()


# --- the fixed-shape (padded, sync-free) decode step of the CUDA-graph path, run eagerly ----

PADDED = {"cuda_graphs": True}  # on the CPU: the graphs' padded step without capture
EAGER = {"cuda_graphs": False}


def test_padded_decode_equals_eager(checkpoint):
    """Batches of 3, 2 and 1 requests padded to 4, 2 and 1 rows give the plain eager step's
    tokens and swap counters in both placements (so HiSparse == all-GPU on that path too);
    ``offload="always"``, so that the counters count swaps."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 9, 16)]
    prompts = _prompts((40, 23, 70))
    tokens = {}
    for placement in ("gpu", "hisparse"):
        eager = _run(checkpoint, placement, params=params, prompts=prompts, llm_kw=EAGER,
                     **ALWAYS)  # fmt: skip
        with LLM(
            checkpoint,
            kv_placement=placement,
            kv_format="bf16",
            max_model_len=128,
            max_num_seqs=4,
            gpu_memory_gib=0.02,
            cuda_graphs=True,
            hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4, **ALWAYS),
        ) as llm:
            padded = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            assert llm.runner.graphs is not None and not llm.runner.graphs.capture
            assert set(llm.runner.graphs.steps) == {4, 2, 1}  # every padded size ran
        assert _tokens(padded) == _tokens(eager)
        for a, b in zip(padded, eager, strict=True):
            assert (a.metrics.hits, a.metrics.misses) == (b.metrics.hits, b.metrics.misses)
        tokens[placement] = _tokens(padded)
    assert tokens["hisparse"] == tokens["gpu"]


def test_padded_decode_lossless_at_minimum_hot_buffer_and_under_preemption(checkpoint):
    long = SamplingParams(temperature=0, max_tokens=60)
    prompts = _prompts((20, 23, 30))
    ref = _run(checkpoint, "gpu", params=long, prompts=prompts, top_k=4, llm_kw=EAGER)
    tight = _run(
        checkpoint,
        "hisparse",
        blocks=requests_pool(1.75),
        top_k=4,
        params=long,
        prompts=prompts,
        device_buffer_size=4,
        llm_kw=PADDED,
        **ALWAYS,
    )
    assert sum(o.metrics.preemptions for o in tight) > 0
    assert _tokens(tight) == _tokens(ref)


@pytest.mark.parametrize("synthetic", [True, False], ids=["synthetic", "model-prefill"])
def test_padded_decode_replays_the_same_selections(checkpoint, synthetic):
    """Top-k replay on the padded path: padded rows use a spare replay slot, the selections
    are those of the eager step, logged once per real row."""
    prompts = _prompts((30, 45, 21), seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for name, kw in (("eager", EAGER), ("padded", PADDED)):
        with LLM(
            checkpoint,
            kv_placement="hisparse",
            kv_format="bf16",
            max_model_len=96,
            max_num_seqs=4,
            gpu_memory_gib=0.02,
            step_hooks=BenchHooks(topk_overlap=0.8, synthetic_prefill=synthetic),
            hisparse=HiSparseConfig(
                host_pool_gib=0.01, block_size=4, device_buffer_size=32, **ALWAYS
            ),
            **kw,
        ) as llm:
            llm.runner.hooks.replay.log = []
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            log = sorted((k, n, ld, s.tolist()) for ld, k, n, s in llm.runner.hooks.replay.log)
        runs[name] = (_tokens(outs), log, sum(o.metrics.misses for o in outs))
    assert runs["padded"] == runs["eager"]
    assert runs["padded"][2] > 0


@torch.no_grad()  # inference, as in the engine
def test_sync_free_moe_matches_the_per_expert_loop():
    """Every expert on every row, masked by the routing: the per-expert loop's sum, bit for
    bit when the loop's experts also see every row (the only difference is the matmul's row
    count, which changes the GEMM's summation order by ~1 ulp), and close to the loop."""
    from hisparse.models.deepseek_v32 import MoE
    from hisparse.models.dsa_config import DsaConfig
    from hisparse.models.tiny import tiny_config_kwargs

    cfg = DsaConfig.from_dict(dict(model_type="deepseek_v32", **tiny_config_kwargs("deepseek_v32")))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(7, cfg.hidden_size)
    dense = moe(x, sync_free=True)
    weights, ids = moe.gate(x)
    same_rows = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        y = moe.experts[e](x)[tok] * weights[tok, slot, None]  # expert on all rows, then pick
        same_rows.index_add_(0, tok, y)
    assert torch.equal(dense, same_rows + moe.shared_experts(x))
    torch.testing.assert_close(dense, moe(x), rtol=1e-5, atol=1e-5 * float(dense.abs().max()))


def test_triton_swap_in_stays_lossless_when_the_batch_shrinks(
    checkpoint, monkeypatch, forbid_reference
):
    """The gathers walk every row of the swap lists: when the middle request finishes and the
    last one moves up a row, resolve must leave no stale count past this step's requests, or
    the old copies land in hot slots that hold other rows by now (the Triton resolve once
    wrote only this step's counts; both decode paths then diverged from all-GPU). The Triton
    ops run, not the reference's (which raise here)."""
    pytest.importorskip("triton")
    from hisparse.runtime.ops import OP_NAMES, reference

    prompts = _prompts((40, 23, 70), seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 2, 6)]
    ref = _run(checkpoint, "gpu", params=params, prompts=prompts, llm_kw=EAGER)
    monkeypatch.setenv("HISPARSE_OPS", "triton")
    forbid_reference(*(getattr(reference, name) for name in OP_NAMES))
    for kw in (EAGER, PADDED):
        hs = _run(checkpoint, "hisparse", params=params, prompts=prompts, llm_kw=kw, **ALWAYS)
        assert _tokens(hs) == _tokens(ref)


def test_decode_path_falls_back_where_a_step_cannot_be_captured(monkeypatch):
    """Graphs by default on CUDA; a part that reads device values on the host (quest, a
    PyTorch reference backend) makes the default run the same step uncaptured, with a
    warning, and makes an explicit cuda_graphs=True an error that says what to pass."""
    pytest.importorskip("triton")
    from hisparse.engine.device import capture_blockers
    from hisparse.engine.device import decode_path as _decode_path

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("HISPARSE_OPS", raising=False)
    monkeypatch.delenv("HISPARSE_INDEXER", raising=False)
    monkeypatch.delenv("HISPARSE_ATTENTION", raising=False)
    assert _decode_path(None, cpu) == "eager" and _decode_path(True, cpu) == "padded"
    assert _decode_path(False, cuda) == "eager"
    assert capture_blockers(cuda, "fp8") == [] and _decode_path(None, cuda) == "graphs"
    with pytest.warns(UserWarning, match="quest"):
        assert _decode_path(None, cuda, "quest") == "padded"
    with pytest.raises(ValueError, match="cuda_graphs=False"):
        _decode_path(True, cuda, "quest")
    for ops in ("reference", "cpu"):
        monkeypatch.setenv("HISPARSE_OPS", ops)
        assert "not the Triton kernels" in capture_blockers(cuda, "fp8")[0]
    monkeypatch.setenv("HISPARSE_OPS", "auto")
    monkeypatch.setenv("HISPARSE_INDEXER", "reference")
    assert capture_blockers(cuda, "fp8") == ["HISPARSE_INDEXER=reference"]
