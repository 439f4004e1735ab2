"""A hypothesis state machine over the scheduler and the KV accounting with prefix caching
(torch-free, no model: every sampled token is a function of the request's tokens so far):
random workloads of prompts sharing prefixes of two documents, arriving at any time, some
aborted, small pools that make requests wait, preempt and evict cached pages. After every
step: each block's reference count is the number of requests holding it, a cached block no
one holds waits in its pool's LRU list, and no step writes a page whose block is shared or
cached; at the end every block returns once the cache is cleared."""

from __future__ import annotations

from collections import Counter

from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.engine.kv_blocks import KVBlockManager
from hisparse.engine.request import Request, Status
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.step_data import ModelOutput
from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat

BS = 4
SPECS = []
for _i in range(2):
    _name = f"layers.{_i}.attn"
    SPECS.append(LayerCacheSpec(_name, CacheKind.SPARSE, 64, BS, RowFormat.BF16_MLA, _name))
    SPECS.append(LayerCacheSpec(f"layers.{_i}.indexer", CacheKind.INDEXER, 32, BS))
DOCS = [[(7 * i + 3) % 97 + 1 for i in range(40)], [(5 * i + 11) % 89 + 1 for i in range(40)]]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVBlockManager | None = None
        self.sched: Scheduler | None = None
        self.reqs: list[Request] = []

    @precondition(lambda self: self.kv is None)
    @rule(
        placement=st.sampled_from(["hisparse", "gpu"]),
        offload=st.sampled_from(["always", "under_pressure"]),
        gpu_kib=st.integers(6, 40),
        host_blocks=st.integers(18, 60),
        budget=st.sampled_from([4, 8, 32]),
        eager=st.booleans(),
    )
    def start(self, placement, offload, gpu_kib, host_blocks, budget, eager):
        host_block = 2 * 64 * BS + 2 * 32 * BS  # rows and the indexer copy
        cfg = HiSparseConfig(
            top_k=4,
            host_pool_gib=(host_blocks * host_block + 1) / 2**30,
            block_size=BS,
            offload=offload,
            eager_host_mirror=eager,
        ).resolve()
        try:
            kv = KVBlockManager(
                SPECS,
                cfg,
                placement=placement,
                gpu_budget_bytes=gpu_kib << 10,
                max_model_len=64,
                max_num_seqs=3,
                max_num_batched_tokens=budget,
                prefix_caching=True,
            )
        except HiSparseConfigError:
            assume(False)  # a pool smaller than one max_model_len request
        self.kv = kv
        self.sched = Scheduler(self.kv, max_num_seqs=3, max_num_batched_tokens=budget)

    @precondition(lambda self: self.kv is not None and len(self.reqs) < 12)
    @rule(
        doc=st.integers(0, 1),
        shared=st.integers(0, 40),
        tail=st.lists(st.integers(1, 99), max_size=10),
        max_tokens=st.integers(1, 12),
    )
    def add(self, doc, shared, tail, max_tokens):
        prompt = DOCS[doc][:shared] + tail or [1]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        req = Request(f"r{len(self.reqs)}", prompt, params)
        self.reqs.append(req)
        self.sched.add(req)

    @precondition(lambda self: self.sched is not None and self.sched.has_work)
    @rule()
    def step(self):
        kv, sched = self.kv, self.sched
        out = sched.schedule()
        for part in out.parts:
            for req, n in part.batch:
                self._check_writes(req, req.num_computed, n)
            sampled = [r for (r, _), f in zip(part.batch, part.finishing, strict=True)
                       if f or part.decode]  # fmt: skip
            toks = [sum(r.token_slice(0, r.num_computed + n)) % 97 + 1
                    for (r, n), f in zip(part.batch, part.finishing, strict=True)
                    if f or part.decode]  # fmt: skip
            sched.update_from_output(part, ModelOutput(sampled, toks, [None] * len(toks), 0.0))
        assert kv is not None

    @precondition(lambda self: self.sched is not None and self.sched.running)
    @rule(i=st.integers(0, 2))
    def abort(self, i):
        sched = self.sched
        sched.abort(sched.running[i % len(sched.running)])

    @precondition(lambda self: self.kv is not None)
    @rule()
    def clear(self):
        """`LLM.reset_prefix_cache` at any time: what no request holds goes."""
        cache = self.kv.prefix_cache
        cache.clear()
        assert cache.pool.num_evictable == 0

    def _check_writes(self, req: Request, start: int, n: int) -> None:
        """No step writes a page whose block another request holds or the cache names."""
        kv = self.kv
        b = kv.requests[req.req_id]
        for p in range(start // BS, (start + n - 1) // BS + 1):
            assert p >= b.shared_pages
            if kv.hisparse:
                blk, pool = b.host[p], kv.host_blocks
            else:
                blk, pool = b.resident[0][p], kv.gpu_blocks
            assert pool.ref_count(blk) == 1 and not pool.is_cached(blk), (req.req_id, p)

    @invariant()
    def refcounts_are_holders(self):
        kv = self.kv
        if kv is None:
            return
        gpu, host = Counter(), Counter()
        for b in kv.requests.values():
            host.update(b.host)
            gpu.update(b.indexer_blocks)
            for res in b.resident:
                gpu.update(res.values())
            for region in b.hot:
                gpu.update(region)
        for pool, held in ((kv.gpu_blocks, gpu), (kv.host_blocks, host)):
            if pool is None:
                continue
            for blk in range(1, pool.num_blocks):
                assert pool.ref_count(blk) == held[blk], (pool.name, blk)
                if held[blk] == 0 and pool.is_cached(blk):
                    assert blk in pool._evictable
            assert pool.num_free == pool.num_usable - len(held)
        cache = kv.prefix_cache
        assert all(cache.pool.is_cached(blk) for blk in cache._hash_of)

    def teardown(self):
        kv, sched = self.kv, self.sched
        if kv is None:
            return
        for _ in range(2000):
            if not sched.has_work:
                break
            self.step()
        assert not sched.has_work and not kv.requests
        for r in self.reqs:
            assert r.status is Status.FINISHED
        print(
            "HITS",
            kv.hisparse,
            kv.prefix_cache.hits,
            kv.prefix_cache.queries,
            len(self.reqs),
            sum(r.metrics.preemptions for r in self.reqs),
        )
        kv.prefix_cache.clear()
        assert len(kv.prefix_cache) == 0
        for pool in (kv.gpu_blocks, kv.host_blocks):
            if pool is not None:
                assert pool.num_free == pool.num_usable and pool.num_evictable == 0


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
