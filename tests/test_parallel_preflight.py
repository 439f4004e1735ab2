"""A parallel engine's configuration errors come from the driver before any rank starts,
with the error type and text one rank raises (issue #54): no ``TensorParallelError`` wrapping
a rank's traceback."""

from __future__ import annotations

import pytest

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.parallel.group import TPGroup
from hisparse.validation import HiSparseConfigError

SMALL = dict(max_num_seqs=2, gpu_memory_gib=0.02, device="cpu")


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started for a configuration that cannot run")

    monkeypatch.setattr(TPGroup, "start", refuse)


def test_dsa_errors_match_one_rank(tiny_checkpoint, no_ranks):
    path = tiny_checkpoint("deepseek_v32")
    bad = [
        dict(max_model_len=10**6, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4)),
        dict(max_model_len=64,
             hisparse=HiSparseConfig(host_pool_gib=0.01, top_k=64, device_buffer_size=8)),
        # a host pool too small for one request (its block size from config.json's row
        # formats; without the prefix cache, which tensor parallelism turns off)
        dict(max_model_len=1024, hisparse=HiSparseConfig(host_pool_gib=0.0005, block_size=4),
             kv_format="bf16", enable_prefix_caching=False),
    ]  # fmt: skip
    for kw in bad:
        with pytest.raises(HiSparseConfigError) as one:
            LLM(path, **SMALL, **kw)
        for parallel in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
            with pytest.raises(HiSparseConfigError) as two:
                LLM(path, **SMALL, **kw, **parallel)
            assert type(two.value) is type(one.value) and str(two.value) == str(one.value)


def test_gqa_top_k_below_the_window_is_refused_on_the_driver(no_ranks):
    pytest.importorskip("hisparse.models.smollm2").smollm2_gguf_path()
    with pytest.raises(ValueError, match=r"top_k=16 is smaller than sink_tokens \+ recent_window"):
        LLM("smollm2", hisparse=HiSparseConfig(top_k=16), tensor_parallel_size=3, **SMALL)


def test_host_pool_too_small_with_the_prefix_cache(tiny_checkpoint, no_ranks):
    """Each data-parallel rank's host blocks hold the prefix cache's indexer copy, as one
    rank's do: the driver's error is one rank's, byte for byte."""
    path = tiny_checkpoint("deepseek_v32")
    kw = dict(max_model_len=1024, hisparse=HiSparseConfig(host_pool_gib=0.0005, block_size=4))
    with pytest.raises(HiSparseConfigError, match="the host pool of") as one:
        LLM(path, **SMALL, **kw)
    with pytest.raises(HiSparseConfigError) as two:
        LLM(path, **SMALL, **kw, data_parallel_size=2)
    assert str(two.value) == str(one.value)
