"""Lossless on real weights: SmolLM2-135M-Instruct (the bundled GGUF) served by the engine with
prompts longer than top_k gives the same greedy tokens with the KV cache in the HiSparse host
pool as with every row on the GPU (CPU), also with the hot buffer at its minimum."""

from __future__ import annotations

import pytest

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

TOP_K = 96  # above the indexer's 4 sinks + 64-token window, below the prompts


def _prompts(llm: LLM) -> list[list[int]]:
    from pydoc_data.topics import topics

    texts = [topics["for"][:1100], topics["while"][:900]]
    return [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


#: Finished runs by their arguments: the same greedy run is the baseline of two tests below.
_RUNS: dict[tuple, tuple[list[list[int]], list]] = {}


def _generate(
    placement: str, max_num_batched_tokens: int = 2048, **hs
) -> tuple[list[list[int]], list]:
    key = (placement, max_num_batched_tokens, *sorted(hs.items()))
    if key not in _RUNS:
        _RUNS[key] = _generate_uncached(placement, max_num_batched_tokens, **hs)
    return _RUNS[key]


def _generate_uncached(
    placement: str, max_num_batched_tokens: int, **hs
) -> tuple[list[list[int]], list]:
    cfg = HiSparseConfig(top_k=TOP_K, host_pool_gib=0.25, **hs)
    with LLM(
        "smollm2",
        kv_placement=placement,
        hisparse=cfg,
        max_model_len=1024,
        gpu_memory_gib=0.25,
        max_num_seqs=2,
        max_num_batched_tokens=max_num_batched_tokens,
    ) as llm:
        prompts = _prompts(llm)
        assert min(len(p) for p in prompts) > 2 * TOP_K
        outs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=16)
        )
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], outs


def test_smollm2_hisparse_equals_all_gpu():
    """The default offload policy (the prompts fit: every page stays resident) and
    ``offload="always"`` (rows read through the hot buffer, also at its minimum size)."""
    gpu, _ = _generate("gpu")
    assert _generate("hisparse")[0] == gpu
    hs, outs = _generate("hisparse", offload="always")
    assert hs == gpu
    assert sum(o.metrics.misses for o in outs) > 0  # rows really came from the host pool
    minimal, _ = _generate("hisparse", device_buffer_size=TOP_K, offload="always")
    assert minimal == gpu


def test_chunked_prefill_equals_one_step():
    """Prompts prefilled in chunks of 100 tokens (each attending to the earlier chunks,
    queries scored and attended per token) give the one-step prefill's tokens."""
    whole, _ = _generate("hisparse")
    for placement in ("hisparse", "gpu"):
        chunked, _ = _generate(placement, max_num_batched_tokens=100)
        assert chunked == whole, placement


def test_text_prompts_and_stop_strings():
    with LLM(
        "smollm2",
        hisparse=HiSparseConfig(top_k=TOP_K, host_pool_gib=0.25),
        max_model_len=512,
        gpu_memory_gib=0.1,
        max_num_seqs=2,
    ) as llm:
        outs = llm.generate(
            ["The capital of France is", "1, 2, 3, 4,"],
            SamplingParams(temperature=0, max_tokens=12, stop=[" 7"]),
        )
    assert all(o.ok for o in outs)
    assert outs[1].finish_reason == "stop" and " 7" not in outs[1].text
    assert outs[0].text.strip()


def test_smollm2_long_prompt_in_chunks_equals_one_step():
    """Real weights, real text, a prompt of 2,200 tokens (longer than the default prefill
    step of 2,048): prefilled in chunks of 512 (HiSparse: 5 chunks) and of 2,048 (all-GPU: 2)
    it gives the greedy tokens of the same prompt in one step (all-GPU), so both placements
    and both chunkings agree."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    n = 2200
    runs = {}
    for placement in ("gpu", "hisparse"):
        with LLM(
            "smollm2",
            kv_placement=placement,
            hisparse=HiSparseConfig(host_pool_gib=0.5),
            max_model_len=8192,
            gpu_memory_gib=0.5,
            max_num_seqs=1,
            enable_prefix_caching=False,  # each run prefills the prompt again, in its chunks
        ) as llm:
            prompt = llm.tokenizer.encode(text)[:n]
            assert len(prompt) == n
            chunks = (n, 2048) if placement == "gpu" else (512,)
            for chunk in chunks:
                llm.scheduler.max_num_batched_tokens = chunk
                (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
                assert out.ok, out.error
                prefill = [s["tokens"] for s in llm.last_run_stats if not s["decode"]]
                assert prefill == [chunk] * (n // chunk) + ([n % chunk] * (n % chunk > 0))
                runs[placement, chunk] = out.token_ids
    one = runs["gpu", n]
    assert len(one) == 8
    assert all(tokens == one for tokens in runs.values()), runs
