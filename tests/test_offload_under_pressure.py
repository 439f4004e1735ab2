"""``HiSparseConfig(offload="under_pressure")``: pages stay resident while the GPU pool has
room, and go to the host only when another request needs the blocks (CPU).

Lossless against the all-GPU placement on both DSA architectures and on SmolLM2's real weights,
with room (nothing read through the hot buffer) and under pressure (requests demoted, their
rows read back through the hot buffer), with the eager and the lazy host mirror, under both
schedules; and the pressure never costs capacity: the same requests run at once as with
``offload="always"``.
"""

from __future__ import annotations

import pytest

from hisparse import HiSparseConfig
from hisparse.config import HiSparseConfigError
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from test_engine import _prompts, _run, _tokens, requests_pool

LONG = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def _run_probe(path, placement, *, blocks=None, params=LONG, prompts=None, llm_kw=None, **hs):
    """`test_engine._run`, and the engine's demotions and most requests decoding at once."""
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, **hs)
    kw = dict(kv_placement=placement, hisparse=cfg, kv_format="bf16", max_model_len=128,
              max_num_seqs=4, **(llm_kw or {}))  # fmt: skip
    gib = 0.02
    if blocks is not None:
        with LLM(path, gpu_memory_gib=gib, **kw) as probe:
            lay = probe.kv.layout
            gib = (blocks(lay) * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    with LLM(path, gpu_memory_gib=gib, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts or _prompts(), sampling_params=params)
        running = max((s["running"] for s in llm.step_stats if s["decode"]), default=0)
        seen = dict(demotions=llm.scheduler.demotions, running=running)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs, seen


def test_with_room_nothing_is_read_through_the_hot_buffer(checkpoint):
    gpu = _run(checkpoint, "gpu", params=LONG)
    outs, seen = _run_probe(checkpoint, "hisparse", params=LONG, offload="under_pressure")
    assert _tokens(outs) == _tokens(gpu)
    assert seen["demotions"] == 0
    # every row attended came from a resident page: no miss, no hit of the hot buffer
    assert sum(o.metrics.misses for o in outs) == 0
    assert sum(o.metrics.hits for o in outs) == 0
    always = _run(checkpoint, "hisparse", params=LONG, offload="always")
    assert sum(o.metrics.misses for o in always) > 0  # the same run with offload="always"


@pytest.mark.parametrize("eager", [True, False], ids=["eager-mirror", "lazy-mirror"])
@pytest.mark.parametrize("schedule", ["mixed", "prefill-first"])
def test_under_pressure_requests_are_demoted_and_stay_lossless(checkpoint, eager, schedule):
    prompts = _prompts((40, 23, 70, 33))
    llm_kw = dict(schedule=schedule)
    # the plan holds the four requests at once, their resident pages do not fit
    pool = requests_pool(4.2)
    ref = _run(checkpoint, "gpu", params=LONG, prompts=prompts, llm_kw=llm_kw)
    outs, seen = _run_probe(checkpoint, "hisparse", blocks=pool, params=LONG, prompts=prompts,
                            llm_kw=llm_kw, offload="under_pressure",
                            eager_host_mirror=eager)  # fmt: skip
    assert _tokens(outs) == _tokens(ref)
    assert seen["demotions"] > 0
    assert sum(o.metrics.misses for o in outs) > 0  # demoted rows came back from the host
    always, seen_always = _run_probe(checkpoint, "hisparse", blocks=pool, params=LONG,
                                     prompts=prompts, llm_kw=llm_kw, offload="always",
                                     eager_host_mirror=eager)  # fmt: skip
    assert seen["running"] == seen_always["running"] == len(prompts)
    assert sum(o.metrics.preemptions for o in outs) == sum(o.metrics.preemptions for o in always)


def test_pressure_with_preemption_stays_lossless(checkpoint):
    """A pool below four requests' plan: demotions first, then preemption with recompute."""
    long = SamplingParams(temperature=0, max_tokens=90)
    prompts = _prompts((20, 23, 30, 33))
    tight, seen = _run_probe(checkpoint, "hisparse", blocks=requests_pool(1.9), top_k=4,
                             params=long, prompts=prompts, offload="under_pressure")  # fmt: skip
    assert seen["demotions"] > 0 and sum(o.metrics.preemptions for o in tight) > 0
    ref = _run(checkpoint, "gpu", params=long, prompts=prompts, top_k=4)
    assert _tokens(tight) == _tokens(ref)


def test_all_resident_matches_the_page_sets_through_demotion_and_preemption(
    checkpoint, monkeypatch
):
    """`KVCacheManager.all_resident` (which decides whether a decode step looks its rows up
    in the resident table, `StepMetadata.all_resident`) counts pages; at every decode step it
    must say what the requests' page sets say: every page below the indexer page count is
    resident in every group. True while the pool has room, False for a demoted request
    (through preemption and recompute too), never with ``offload="always"``."""
    from hisparse.engine.kv_manager import KVCacheManager
    from hisparse.engine.model_runner import ModelRunner

    seen = []
    counted = KVCacheManager.all_resident

    def checked(self, req_ids):
        for r in req_ids:  # request by request, then the batch
            b = self.requests[r]
            want = self.policy.under_pressure and all(
                all(p in res for p in range(len(b.indexer))) for res in b.resident
            )
            assert counted(self, [r]) == want, (r, want)
            seen.append(want)
        return counted(self, req_ids)

    monkeypatch.setattr(KVCacheManager, "all_resident", checked)
    # the runner asks only on CUDA (the CPU keeps its resolve): ask at every decode step here
    runner_asks = ModelRunner._all_resident

    def asks(self, ids):
        self.kv.all_resident(ids)
        return runner_asks(self, ids)

    monkeypatch.setattr(ModelRunner, "_all_resident", asks)
    long = SamplingParams(temperature=0, max_tokens=90)
    prompts = _prompts((20, 23, 30, 33))
    tight, info = _run_probe(checkpoint, "hisparse", blocks=requests_pool(1.9), top_k=4,
                             params=long, prompts=prompts, offload="under_pressure")  # fmt: skip
    assert info["demotions"] > 0 and sum(o.metrics.preemptions for o in tight) > 0
    assert False in seen
    seen.clear()
    _run_probe(checkpoint, "hisparse", params=LONG, offload="under_pressure")
    assert seen and all(seen)  # with room: every decode step
    seen.clear()
    _run_probe(checkpoint, "hisparse", params=LONG, offload="always")
    assert seen and not any(seen)


def test_offload_policy_is_checked(monkeypatch):
    with pytest.raises(HiSparseConfigError, match=r"offload.*'always', 'under_pressure'"):
        HiSparseConfig(offload="never")
    monkeypatch.setenv("HISPARSE_OFFLOAD", "never")
    with pytest.raises(HiSparseConfigError, match=r"HISPARSE_OFFLOAD='never'.*'always'"):
        HiSparseConfig(top_k=4).resolve()
    assert HiSparseConfig(top_k=4, offload="always").resolve().offload == "always"


def test_default_is_under_pressure(checkpoint, monkeypatch):
    """Unset (as a user leaves it), the policy is "under_pressure": with room nothing is read
    through the hot buffer; ``$HISPARSE_OFFLOAD`` overrides it."""
    monkeypatch.delenv("HISPARSE_OFFLOAD", raising=False)
    assert HiSparseConfig(top_k=4).resolve().offload == "under_pressure"
    outs, seen = _run_probe(checkpoint, "hisparse")
    assert _tokens(outs) == _tokens(_run(checkpoint, "gpu", params=LONG))
    assert sum(o.metrics.misses + o.metrics.hits for o in outs) == 0 and seen["demotions"] == 0
    monkeypatch.setenv("HISPARSE_OFFLOAD", "always")
    outs, _ = _run_probe(checkpoint, "hisparse")
    assert sum(o.metrics.misses for o in outs) > 0


def test_smollm2_real_weights_with_room_and_under_pressure():
    smollm2 = pytest.importorskip("hisparse.models.smollm2")
    try:
        smollm2.smollm2_gguf_path()
    except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
        pytest.skip(str(err))
    from pydoc_data.topics import topics

    def generate(placement, gib, **hs):
        cfg = HiSparseConfig(top_k=96, host_pool_gib=0.25, block_size=16, **hs)
        # (without the prefix cache: the three chat prompts share the template's first page,
        # and a request that hits it reads those rows through its hot buffer, design §12.10)
        with LLM("smollm2", kv_placement=placement, hisparse=cfg, max_model_len=1024,
                 gpu_memory_gib=gib, max_num_seqs=3, max_num_batched_tokens=256,
                 enable_prefix_caching=False) as llm:  # fmt: skip
            texts = [topics["for"][:1100], topics["while"][:900], topics["if"][:700]]
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                       for t in texts]  # fmt: skip
            outs = llm.generate(
                prompt_token_ids=prompts,
                sampling_params=SamplingParams(temperature=0, max_tokens=OUT),
            )
            assert all(o.ok for o in outs), [o.error for o in outs]
            lay = llm.kv.layout
            demoted = llm.scheduler.demotions
        return [o.token_ids for o in outs], outs, lay, demoted, [len(p) for p in prompts]

    OUT = 40
    gpu, _, _, _, lens = generate("gpu", 0.25)
    roomy, outs, lay, demoted, _ = generate("hisparse", 0.25, offload="under_pressure")
    assert roomy == gpu and demoted == 0 and sum(o.metrics.misses for o in outs) == 0
    # the plan's need of the three requests and a few blocks more: the prompts keep pages
    # in the slack, and the decodes' new pages then need them back
    blocks = 1 + sum(lay.gpu_blocks_per_request(n + OUT) for n in lens) + 8
    gib = (blocks * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    tight, outs, _, demoted, _ = generate("hisparse", gib, offload="under_pressure")
    assert tight == gpu
    assert demoted > 0 and sum(o.metrics.misses for o in outs) > 0


def test_server_metrics_count_demotions(checkpoint):
    """`/metrics`' ``hisparse:num_demotions`` follows the scheduler's count (prometheus-client
    registry of the server, fed by a real engine's steps)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from hisparse.serve.metrics import ServerMetrics

    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, offload="under_pressure")
    kw = dict(hisparse=cfg, kv_format="bf16", max_model_len=128, max_num_seqs=4)
    with LLM(checkpoint, gpu_memory_gib=0.02, **kw) as probe:
        lay = probe.kv.layout
        gib = (requests_pool(4.2)(lay) * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    metrics = ServerMetrics("tiny")
    with LLM(checkpoint, gpu_memory_gib=gib, **kw) as llm:
        for prompt in _prompts((40, 23, 70, 33)):
            llm.add_request(prompt, LONG)
        while llm.has_unfinished_requests():
            metrics.after_step(llm, llm.step())
        demoted = llm.scheduler.demotions
    text = generate_latest(metrics.registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("hisparse:num_demotions_total{"))
    assert demoted > 0 and float(line.rsplit(" ", 1)[1]) == demoted


def test_reclaimable_counts_what_a_demotion_frees(checkpoint, monkeypatch):
    """`KVCacheManager.reclaimable` (counted from the tail, not over the context) equals the
    pages a demotion would drop, after every schedule: prompt chunks grown past the computed
    tokens included."""
    from hisparse.config import cdiv
    from hisparse.engine.scheduler import Scheduler
    from hisparse.kv.layout import RESIDENT_TAIL_PAGES

    original = Scheduler.schedule
    checked = []

    def schedule(self):
        parts = original(self)
        kv = self.kv
        for r in self.running:
            keep_from = max(cdiv(r.num_computed, kv.block_size) - RESIDENT_TAIL_PAGES, 0)
            res = kv.requests[r.req_id].resident
            want = sum(1 for pages in res for p in pages if p < keep_from)
            assert kv.reclaimable(r.req_id, r.num_computed) == want
            checked.append(want)
        return parts

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    _, seen = _run_probe(checkpoint, "hisparse", blocks=requests_pool(4.2),
                            prompts=_prompts((40, 23, 70, 33)), offload="under_pressure",
                            llm_kw=dict(max_num_batched_tokens=16))  # fmt: skip
    assert seen["demotions"] > 0 and max(checked) > 0


@pytest.mark.parametrize("placement", ["hisparse", "gpu"])
def test_a_growth_skipped_within_its_pages_has_them(checkpoint, monkeypatch, placement):
    """The scheduler skips `KVCacheManager.grow` for a decode within the pages the last
    growth completed (`grows`): after every schedule, under pressure (a demotion releases
    older pages and resets the count), every scheduled request holds its host and indexer
    pages (HiSparse) and, in every resident group, the page its last new token lands on."""
    from hisparse.config import cdiv
    from hisparse.engine.scheduler import Scheduler

    original = Scheduler.schedule
    skipped = []

    def schedule(self):
        kv = self.kv
        before = {r.req_id: kv.needs_growth(r.req_id, r.num_computed + 1) for r in self.running}
        out = original(self)
        for part in out.parts:
            for r, n in part.batch:
                b = kv.requests[r.req_id]
                pages = cdiv(r.num_computed + n, kv.block_size)
                if kv.hisparse:
                    assert len(b.host) >= pages and len(b.indexer) >= pages
                assert all(pages - 1 in res for res in b.resident)
                if part.decode and not before.get(r.req_id, True):
                    skipped.append(r.req_id)
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    _, seen = _run_probe(checkpoint, placement, blocks=requests_pool(4.2),
                         prompts=_prompts((40, 23, 70, 33)), offload="under_pressure",
                         llm_kw=dict(max_num_batched_tokens=16))  # fmt: skip
    assert skipped  # most decodes stay within their page (block_size 4)
    if placement == "hisparse":
        assert seen["demotions"] > 0
