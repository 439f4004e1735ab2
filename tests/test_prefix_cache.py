"""Prefix caching (docs/design.md §12.10): the block pool's LRU of cached blocks, the chained
page hashes, and end to end on the tiny DSA checkpoints: a request whose prompt starts like an
earlier one's takes the cached pages and gives the tokens it gives without the cache, in both
placements and both offload policies, with chunked prompts, prefixes that end mid-page and on
a page boundary, a second turn over the first one's generated tokens, and a host pool small
enough that cached pages are evicted."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.prefix_cache import PrefixCache, page_hashes
from hisparse.engine.sampling import SamplingParams
from hisparse.kv.block_pool import BlockPool

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# --- the pool and the hashes ---------------------------------------------------------------
def test_cached_blocks_wait_in_lru_order_and_count_as_free():
    pool = BlockPool(6)
    evicted: list[int] = []
    pool.on_evict = evicted.extend
    a = pool.allocate(5)
    for b in a[:3]:
        pool.mark_cached(b)
    pool.free([a[1]])
    pool.free([a[0]])
    pool.free([a[2]])
    assert pool.num_free == 3 and pool.num_evictable == 3
    pool.incref([a[0]])  # a hit takes it back
    assert pool.num_free == 2 and pool.ref_count(a[0]) == 1
    assert pool.allocate(1) == [a[1]] and evicted == [a[1]]  # least recently released
    pool.free(a[3:])  # plain blocks: free, not cached
    assert pool.allocate(2) == a[3:] and evicted == [a[1]]  # free ones first
    assert pool.allocate(1) == [a[2]] and evicted == [a[1], a[2]]
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[1], a[1]])


def test_evict_all_returns_every_unheld_cached_block():
    pool = BlockPool(5)
    a = pool.allocate(4)
    for b in a:
        pool.mark_cached(b)
    pool.free(a[:3])
    assert sorted(pool.evict_all()) == sorted(a[:3])
    assert pool.num_evictable == 0 and pool.num_free == 3
    pool.free(a[3:])
    assert pool.evict_all() == a[3:] and pool.num_free == 4


def test_page_hashes_chain_over_the_whole_prefix():
    toks = list(range(40))
    h = page_hashes(toks, BS, b"k")
    assert len(h) == 2  # full pages only
    other = page_hashes([1, *toks[1:]], BS, b"k")
    assert h[0] != other[0] and h[1] != other[1]  # page 1 differs by page 0's token
    assert page_hashes(toks, BS, b"other")[0] != h[0]  # the key (model, format) counts
    assert page_hashes(toks[BS:], BS, b"k", parent=h[0]) == h[1:]  # extends a chain


def test_lookup_is_the_longest_cached_run_and_eviction_forgets():
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS, b"k")
    known: list[bytes] = []
    toks = list(range(64))
    hashes = cache.hashes(known, 4, lambda s, n: toks[s : s + n])
    blocks = pool.allocate(4)
    for h, b in zip(hashes[:3], blocks[:3], strict=True):
        assert cache.register(h, b)
    assert not cache.register(hashes[0], blocks[3])  # cached already, elsewhere
    assert cache.lookup(hashes) == blocks[:3]
    pool.free(blocks)
    pool.allocate(5)  # 4 free blocks, then the least recently released cached one
    assert cache.lookup(hashes) == [] and len(cache) == 2
    assert cache.clear() == 2 and len(cache) == 0


# --- end to end -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint):
    """One architecture for the scheduling cases (the lossless cases above run both)."""
    return tiny_checkpoint("deepseek_v32")


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _llm(path, placement, caching, *, offload=None, host_gib=0.05, chunk=64, seqs=2, **kw):
    return LLM(
        path,
        kv_placement=placement,
        kv_format="bf16",
        max_model_len=kw.get("max_len", 512),
        max_num_batched_tokens=chunk,
        gpu_memory_gib=kw.get("gpu_gib", 0.05),
        max_num_seqs=seqs,
        hisparse=HiSparseConfig(host_pool_gib=host_gib, block_size=BS, offload=offload),
        enable_prefix_caching=caching,
    )


DOC = _prompt(150, 1)
#: one after another: a prefix ending mid-page (150 = 9 pages + 6), one ending on a page
#: boundary (144), the same prompt again (all but its last token cached: 9 pages)
PROMPTS = [DOC + _prompt(20, 2), DOC[:144] + _prompt(30, 3), DOC + _prompt(5, 4), DOC]


def _turns(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Each prompt of `PROMPTS` alone, then a second turn over the first's answer."""
    toks, cached = [], []
    for p in PROMPTS:
        out = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
        assert out.ok, out.error
        toks.append(out.token_ids)
        cached.append(out.metrics.cached_tokens)
    second = PROMPTS[0] + toks[0] + _prompt(7, 5)
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    toks.append(out.token_ids)
    cached.append(out.metrics.cached_tokens)
    return toks, cached


@pytest.mark.parametrize(
    "placement, offload",
    [("gpu", None), ("hisparse", "under_pressure"), ("hisparse", "always")],
)
def test_cached_prefixes_give_the_uncached_tokens(checkpoint, placement, offload):
    with _llm(checkpoint, placement, False, offload=offload) as llm:
        want, none = _turns(llm)
    assert none == [0] * 5
    with _llm(checkpoint, placement, True, offload=offload) as llm:
        got, cached = _turns(llm)
        cache = llm.kv.prefix_cache
        assert cache is not None and cache.hits == sum(cached)
    assert got == want
    # the first prompt's 10 full pages; 144 tokens on a boundary; 9 pages + 6 of the doc;
    # the doc itself short of its last token; the first turn's 178 computed tokens (11 pages)
    assert cached == [0, 144, 144, 144, 176]


def test_n_completions_prefill_their_prompt_once(deepseek):
    """``n = 4`` over one prompt: the first completion prefills it, the others wait for its
    pages and prefill only the last, partial page (seeded sampling: four different answers,
    the same with the cache as without)."""
    prompt = _prompt(200, 6)  # 12 full pages + 8
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=6, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        with _llm(deepseek, "hisparse", caching, chunk=512, seqs=4) as llm:
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            assert out.ok, out.error
            prefilled = sum(r["tokens"] for r in llm.last_run_stats if not r["decode"])
            runs[caching] = [o.token_ids for o in out.outputs], prefilled
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 4 * 200
    assert runs[True][1] == 200 + 3 * 8


def _small(path, placement, caching, *, pool_blocks, seqs=2):
    """An engine of ``max_model_len`` 128 whose pool (host under HiSparse, GPU on all-GPU)
    holds ``pool_blocks`` blocks."""
    with _llm(path, placement, True, max_len=128) as probe:
        lay = probe.kv.layout
        block = lay.host_block_bytes if placement == "hisparse" else lay.gpu_bytes_per_block
        gib = (pool_blocks + 0.5) * block / 2**30
    if placement == "hisparse":
        return _llm(path, placement, caching, host_gib=gib, max_len=128, seqs=seqs)
    return _llm(path, placement, caching, gpu_gib=gib, max_len=128, seqs=seqs)


def test_evicted_pages_are_recomputed_with_the_same_tokens(deepseek):
    """A host pool of 14 blocks: three documents one after another evict the first one's
    cached pages (least recently used first), so its second question recomputes them."""
    docs = [_prompt(100, 10 + i) for i in range(3)]
    prompts = [d + _prompt(8, 20 + i) for i, d in enumerate(docs)] + [docs[0] + _prompt(9, 30)]
    runs = {}
    for caching in (False, True):
        with _small(deepseek, "hisparse", caching, pool_blocks=14) as llm:
            outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
                    for p in prompts]  # fmt: skip
            assert all(o.ok for o in outs), [o.error for o in outs]
            runs[caching] = [o.token_ids for o in outs]
            if caching:
                assert llm.kv.prefix_cache.evictions > 0
                assert outs[-1].metrics.cached_tokens < 96  # not all of the first document
    assert runs[True] == runs[False]


def test_preemption_with_the_cache_keeps_the_tokens(deepseek):
    """All-GPU, a pool of one ``max_model_len`` request: decoding requests outgrow it and
    the newest is preempted, its registered pages left in the cache for its recompute (which
    the others' growth evicts first here: the pool is full) with the same tokens."""
    prompts = [_prompt(20, 40 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        with _small(deepseek, "gpu", caching, pool_blocks=9, seqs=3) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            assert all(o.ok for o in outs), [o.error for o in outs]
            assert sum(o.metrics.preemptions for o in outs) > 0
            runs[caching] = [o.token_ids for o in outs]
    assert runs[True] == runs[False]


def test_smollm2_questions_over_one_document_all_gpu():
    """Real weights and text (the bundled SmolLM2, all-GPU placement: the HiSparse case is
    `tests/test_serve_prefix_cache.py`'s): two questions over one document, the second
    prefilled from the first's cached pages, the same answers as without the cache."""
    smollm2 = pytest.importorskip("hisparse.models.smollm2")
    smollm2.smollm2_gguf_path()
    from pydoc_data.topics import topics

    doc = topics["while"][:900]
    runs = {}
    for caching in (False, True):
        with LLM(
            "smollm2", kv_placement="gpu", max_model_len=512, gpu_memory_gib=0.1,
            max_num_seqs=1, hisparse=HiSparseConfig(block_size=BS, top_k=96),
            enable_prefix_caching=caching,
        ) as llm:  # fmt: skip
            outs = llm.chat(
                [[{"role": "user", "content": f"{doc}\n\n{q}"}] for q in ("What is it?", "Why?")],
                SamplingParams(temperature=0, max_tokens=6),
            )
            runs[caching] = [o.token_ids for o in outs], [o.metrics.cached_tokens for o in outs]
    assert runs[True][0] == runs[False][0]
    assert runs[True][1][0] == 0 and runs[True][1][1] >= 160


def test_a_hit_under_pressure_reads_its_prefix_in_place(deepseek):
    """``offload="under_pressure"`` with room in the GPU pool: a hit's shared pages become
    resident (their rows copied from the host blocks before its first forward), so the
    request reads its whole context in place, as one that prefilled it (no row through its
    hot buffer: no hits, no misses), with the tokens of an engine without the cache."""

    def run(llm: LLM) -> list:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in PROMPTS]
        assert all(o.ok for o in outs), [o.error for o in outs]
        return outs

    with _llm(deepseek, "hisparse", False, offload="under_pressure") as llm:
        want = [o.token_ids for o in run(llm)]
    with _llm(deepseek, "hisparse", True, offload="under_pressure") as llm:
        got = run(llm)
    assert [o.token_ids for o in got] == want
    assert [o.metrics.cached_tokens for o in got] == [0, 144, 144, 144]
    assert [(o.metrics.hits, o.metrics.misses) for o in got] == [(0, 0)] * 4
