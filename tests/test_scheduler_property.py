"""Property-based test of the scheduler on a tiny DSA checkpoint (CPU): whatever the prompt
lengths (up to several times the step budget), the budget, ``max_num_seqs``, the order the
requests arrive in and the pool sizes (small enough that requests wait for host blocks and are
preempted for GPU blocks), every request gets the tokens it gets alone, and every block, slot
and host block is back in its pool afterwards."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

MAX_MODEL_LEN = 160
BLOCK = 4
TOP_K = 8
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("glm_moe_dsa", index_topk=TOP_K)


_CFG = dict(block_size=BLOCK, device_buffer_size=2 * TOP_K)
_ENGINE = dict(kv_format="bf16", max_model_len=MAX_MODEL_LEN)


@functools.cache
def _sizes(path, placement: str, budget: int) -> tuple[int, int, int, int, int]:
    """(GPU block bytes, host block bytes, GPU blocks of the smallest pool the engine accepts,
    host blocks of the smallest host pool it accepts, bytes of the prefill staging area)."""
    cfg = HiSparseConfig(host_pool_gib=0.01, **_CFG)
    with LLM(
        path,
        kv_placement=placement,
        gpu_memory_gib=0.01,
        hisparse=cfg,
        max_num_batched_tokens=budget,
        **_ENGINE,
    ) as p:
        kv = p.kv
        # the pool check counts one max_model_len request at its peak; admission and
        # preemption count the same figure (a prefill streams its pages to the host)
        one = 1 + kv.layout.gpu_blocks_per_request(MAX_MODEL_LEN)
        host = kv.layout.host_block_bytes if kv.hisparse else 1
        return (
            kv.layout.gpu_bytes_per_block,
            host,
            one,
            kv.config.min_host_blocks(MAX_MODEL_LEN),
            kv.layout.staging_bytes,
        )


def _llm(path, placement, *, gpu_blocks, host_blocks, max_num_batched_tokens, **kw):
    gpu_block, host_block, _, _, staging = _sizes(path, placement, max_num_batched_tokens)
    cfg = HiSparseConfig(host_pool_gib=host_blocks * host_block / 2**30, **_CFG)
    gib = (gpu_blocks * gpu_block + staging) / 2**30
    return LLM(
        path,
        kv_placement=placement,
        gpu_memory_gib=gib,
        hisparse=cfg,
        max_num_batched_tokens=max_num_batched_tokens,
        **_ENGINE,
        **kw,
    )


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Tokens of each request run alone, in a roomy engine with the default budget."""
    cache: dict[tuple[int, ...], list[int]] = {}
    llm = _llm(
        checkpoint,
        "gpu",
        gpu_blocks=400,
        host_blocks=1,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
    )

    def get(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (*prompt, -1, params.max_tokens)
        if key not in cache:
            (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            assert out.ok, out.error
            cache[key] = out.token_ids
        return cache[key]

    yield get
    llm.close()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    lengths=st.lists(st.integers(1, MAX_MODEL_LEN - MAX_TOKENS), min_size=1, max_size=5),
    max_tokens=st.lists(st.integers(1, MAX_TOKENS), min_size=5, max_size=5),
    budget=st.sampled_from([4, 16, 48]),
    max_num_seqs=st.integers(1, 4),
    placement=st.sampled_from(["hisparse", "gpu"]),
    schedule=st.sampled_from(["mixed", "prefill-first"]),
    gpu_slack=st.one_of(st.just(0), st.integers(0, 30)),
    host_slack=st.one_of(st.just(0), st.integers(0, 30)),
    seed=st.integers(0, 2**16),
)
# A tight all-GPU pool in which four decoding requests outgrow it: one is preempted.
@example([37] * 4, [16] * 5, 16, 4, "gpu", "mixed", 0, 0, 0)
@example([37] * 4, [16] * 5, 16, 4, "gpu", "prefill-first", 5, 0, 0)
def test_every_request_gets_its_tokens_alone_and_all_blocks_return(
    checkpoint,
    alone,
    lengths,
    max_tokens,
    budget,
    max_num_seqs,
    placement,
    schedule,
    gpu_slack,
    host_slack,
    seed,
):
    lengths = [min(m, 4 * budget) for m in lengths]  # up to several steps' budget
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (m,), generator=g).tolist() for m in lengths]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    params = params[: len(prompts)]
    # Pools from "the longest request fits alone" up: requests wait and get preempted.
    _, _, one, host_one, _ = _sizes(checkpoint, placement, budget)
    llm = _llm(
        checkpoint,
        placement,
        gpu_blocks=one + gpu_slack,
        host_blocks=host_one + host_slack,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        schedule=schedule,
    )
    with llm:
        kv = llm.kv
        gpu_free = kv.gpu_blocks.num_free
        host_free = kv.host_blocks.num_free if kv.host_blocks is not None else None
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            assert out.token_ids == alone(prompt, p)
        assert not kv.requests and not llm.scheduler.has_work
        assert kv.gpu_blocks.num_free == gpu_free
        assert kv.host_blocks is None or kv.host_blocks.num_free == host_free
        assert sorted(kv.free_slots) == list(range(max_num_seqs))
