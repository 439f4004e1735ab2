"""What an `LLM` takes it gives back: a failed constructor releases the host pool and the
device pools; ``close()`` releases them at once and the object refuses further use; an
engine dropped without ``close()`` does not block the next one; repeated calls keep memory
flat (freed blocks reused first, bounded statistics); the default host pool is sized to
the model and the machine."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import weakref

import pytest

from api_helpers import prompts, rss_mib, tiny_llm
from hisparse import LLM, HiSparseConfig, SamplingParams
from hisparse.engine import core as engine_core
from hisparse.engine import kv_blocks, kv_manager
from hisparse.engine import llm as llm_module
from hisparse.kv.host_pool import HostPool, live_pool

SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v32")


def _works(path) -> None:
    with tiny_llm(path) as llm:
        assert llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=SHORT)[0].ok


def test_a_bad_argument_takes_nothing(checkpoint):
    """``max_num_seqs=1.5`` used to fail in torch after the host pool was taken, and every
    later LLM() in the process then failed too."""
    with pytest.raises(TypeError, match=r"LLM.max_num_seqs=1.5 must be a positive integer"):
        tiny_llm(checkpoint, max_num_seqs=1.5)
    assert live_pool() is None
    _works(checkpoint)


def test_a_constructor_that_fails_late_releases_everything(checkpoint, monkeypatch):
    """A failure after the pools exist (in the KV manager, or in the runner) gives back the
    host pool and drops the device pool: the next LLM() gets them."""
    made = []
    init = kv_manager.KVCacheManager.__init__

    def recording(self, *a, **k):
        made.append(weakref.ref(self))
        init(self, *a, **k)

    monkeypatch.setattr(kv_manager.KVCacheManager, "__init__", recording)
    real_pool = kv_blocks.BlockPool

    def host_blocks_fail(n, name="block pool"):
        if name == "host block pool":
            raise MemoryError("no room for the host block list")
        return real_pool(n, name)

    with monkeypatch.context() as m:
        m.setattr(kv_blocks, "BlockPool", host_blocks_fail)
        with pytest.raises(MemoryError):
            tiny_llm(checkpoint)
    assert live_pool() is None

    def runner_fails(*a, **k):
        raise RuntimeError("device lost while building the runner")

    with monkeypatch.context() as m:
        m.setattr(llm_module, "ModelRunner", runner_fails)
        with pytest.raises(RuntimeError, match="device lost"):
            tiny_llm(checkpoint)
    assert live_pool() is None
    gc.collect()
    for ref in made:
        kv = ref()
        assert kv is None or (kv.gpu_raw is None and kv.host_pool is None)
    _works(checkpoint)


def test_close_releases_at_once_and_refuses_further_use(checkpoint):
    before = rss_mib()
    llm = tiny_llm(checkpoint, gpu_memory_gib=0.25)  # a device pool of 256 MiB (touched)
    assert rss_mib() - before > 200
    pool = llm.kv.host_pool
    llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=SHORT)
    loaded = rss_mib()
    llm.close()
    assert loaded - rss_mib() > 200  # the device pool is gone now, not at the next collection
    assert pool.size and live_pool() is None and llm.runner is None and llm.model is None
    assert llm.closed
    with pytest.raises(RuntimeError, match=r"this LLM was closed: generate\(\) needs a new"):
        llm.generate(prompt_token_ids=[10, 11, 12])
    with pytest.raises(RuntimeError, match=r"this LLM was closed: chat\(\)"):
        llm.chat([{"role": "user", "content": "hi"}])
    llm.close()  # idempotent
    _works(checkpoint)


def test_dropping_an_engine_without_close_does_not_block_the_next(checkpoint):
    llm = tiny_llm(checkpoint)
    llm.generate(prompt_token_ids=[10, 11, 12], sampling_params=SHORT)
    ref = weakref.ref(llm.kv.host_pool)
    del llm
    _works(checkpoint)  # the dropped engine's pool was released first, not doubled
    assert ref() is None


def test_a_pool_still_held_is_refused_not_doubled(checkpoint):
    with tiny_llm(checkpoint) as held:
        with pytest.raises(RuntimeError, match="already exists"):
            tiny_llm(checkpoint)
        assert live_pool() is held.kv.host_pool
        # the all-GPU placement takes no host pool: it can run beside
        with tiny_llm(checkpoint, kv_placement="gpu") as other:
            assert other.generate(prompt_token_ids=[10, 11], sampling_params=SHORT)[0].ok
    with HostPool(4096, pin=False) as pool:
        assert live_pool() is pool


def test_step_stats_are_bounded(checkpoint, monkeypatch):
    monkeypatch.setattr(engine_core, "STEP_STATS_KEPT", 5)
    with tiny_llm(checkpoint) as llm:
        for _ in range(3):
            llm.generate(prompt_token_ids=prompts((9,)), sampling_params=SHORT)
        assert len(llm.step_stats) == 5  # 3 calls x 3 steps, the last 5 kept
        long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts((9,)), sampling_params=long)
        assert len(llm.last_run_stats) == 12  # the latest call's steps, all of them
        assert [s["decode"] for s in llm.last_run_stats] == [0.0] + [1.0] * 11
        assert list(llm.step_stats) == llm.last_run_stats[-5:]


def test_default_host_pool_is_sized_to_the_model_and_requests(checkpoint):
    from hisparse.engine.device import default_host_pool_bytes as _default_host_pool_bytes
    from hisparse.models.registry import engine_specs

    with tiny_llm(checkpoint, hisparse=HiSparseConfig(block_size=4)) as llm:
        layout = llm.kv.layout
        # 4 requests x (32 pages + a copy-on-write tail) + the null block
        assert layout.host_num_blocks == 4 * (128 // 4 + 1) + 1
        specs = engine_specs(llm.model, llm.runner.row_format, 4)
        cfg, block = llm.config, layout.host_block_bytes
    # capped at half the memory available, but at least one request; below that, refused
    # (a host block holds its page's indexer keys too: prefix caching, on by default)
    size = _default_host_pool_bytes(specs, cfg, 128, 4, available=40 * block, indexer_copy=True)
    assert size == 34 * block
    with pytest.raises(ValueError, match=r"one request of max_model_len=128 needs a host pool"):
        _default_host_pool_bytes(specs, cfg, 128, 4, available=20 * block, indexer_copy=True)


def test_the_kv_budget_must_fit_the_device(checkpoint):
    with pytest.raises(ValueError, match=r"LLM.gpu_memory_gib=1000000.0 must be at most"):
        tiny_llm(checkpoint, gpu_memory_gib=1e6)
    assert live_pool() is None


def test_memory_stays_flat_over_20_calls_on_smollm2():
    """Freed host blocks are reused first: each call used to touch the next untouched pages
    of a large host pool (resident memory grew with every call)."""
    from hisparse.models.smollm2 import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
        pytest.skip(str(err))
    text = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 6
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM("smollm2", max_model_len=2048, max_num_seqs=4, gpu_memory_gib=0.1) as llm:
        assert llm.kv.layout.host_num_blocks >= 100  # the default pool: far more than a call
        (warm,) = llm.generate(text, params)
        assert len(warm.prompt_token_ids) > 64  # two host blocks a call
        gc.collect()
        start = rss_mib()
        for _ in range(20):
            (out,) = llm.generate(text, params)
            assert out.ok
        gc.collect()
        grown = rss_mib() - start
    assert grown < 16, f"resident memory grew {grown:.1f} MiB over 20 calls"
