"""Every public input is checked where it is made. Hypothesis draws values of every field of
`SamplingParams` and `HiSparseConfig` and of `LLM`'s scalar arguments (right and wrong types,
out of range, NaN, infinite, huge, negative, strings, None): each either works (the object is
made and used: a sampler step, an engine that generates) or fails with a `ValueError` /
`TypeError` naming the field, never another exception, and a failed `LLM()` leaves nothing
behind. A batch holding bad requests (bad token ids, empty, too long) finishes the others.
CLI flags go through the same checks and the messages name the flag."""

from __future__ import annotations

import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_helpers import TINY_LLM, prompts, tiny_llm
from hisparse import LLM, HiSparseConfig, SamplingParams
from hisparse.engine.hooks import StepHooks
from hisparse.engine.sampling import _Row, sample_rows
from hisparse.kv.host_pool import live_pool
from hisparse.models.registry import KV_FORMATS

#: Values of any kind: right and wrong types, edges, NaN, infinities, huge numbers.
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.integers(),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63)]),
    st.floats(),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, -0.5, 1e-300, 1e308, float("nan"), float("inf")]),
    st.text(max_size=4),
    st.sampled_from(["auto", "8", "1.5", "nan", "bf16", "fp32", "cpu", "stop"]),
    st.lists(st.integers(-3, 600), max_size=3),
    st.lists(st.text(max_size=3), max_size=3),
    st.lists(st.floats(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from([b"x", object(), torch.float32, (1, "a"), frozenset({3}), range(3)]),
)
SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
CONFIG_FIELDS = [f.name for f in dataclasses.fields(HiSparseConfig)]
QUICK = settings(max_examples=300, deadline=None)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v32")


def _names(err: BaseException, *fields: str) -> None:
    assert isinstance(err, ValueError | TypeError), repr(err)
    assert any(f in str(err) for f in fields), (fields, str(err))


def _use_sampling(p: SamplingParams) -> None:
    """The accepted values have the types the engine relies on, and a sampler step with
    them runs: greedy or drawn, penalties, logprobs."""
    assert isinstance(p.temperature, float) and math.isfinite(p.temperature)
    assert isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop)
    assert all(type(t) is int and t >= 0 for t in p.stop_token_ids)
    for name in ("n", "top_k", "min_tokens"):
        assert type(getattr(p, name)) is int
    assert p.max_tokens is None or (type(p.max_tokens) is int and p.max_tokens >= p.min_tokens)
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    rows = [_Row(p, gen, [3, 4], [5]), _Row(SamplingParams(temperature=0), None)]
    out = sample_rows(logits, rows, {1})
    assert out.tokens[1] == int(logits[1].argmax())
    assert out.tokens[0] is None or 0 <= out.tokens[0] < 40


@QUICK
@given(field=st.sampled_from(SAMPLING_FIELDS), value=ANY)
def test_each_sampling_field(field, value):
    try:
        p = SamplingParams(**{field: value})
    except Exception as err:
        _names(err, f"SamplingParams.{field}")
        return
    _use_sampling(p)


@QUICK
@given(st.fixed_dictionaries({}, optional=dict.fromkeys(SAMPLING_FIELDS, ANY)))
def test_any_sampling_params(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except Exception as err:
        _names(err, *(f"SamplingParams.{f}" for f in kwargs))
        return
    _use_sampling(p)


@QUICK
@given(
    temperature=st.floats(0, 1e6),
    top_p=st.floats(1e-6, 1),
    top_k=st.integers(-1, 10**6),
    max_tokens=st.none() | st.integers(1, 10**9),
    n=st.integers(1, 8),
    seed=st.none() | st.integers(0, 2**64 - 1),
    logprobs=st.none() | st.integers(0, 100),
    rep=st.floats(1e-3, 1e3),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    stop=st.lists(st.text(min_size=1, max_size=3), max_size=3),
    stop_ids=st.lists(st.integers(0, 10**6), max_size=3),
)
def test_valid_sampling_params_are_accepted(
    temperature, top_p, top_k, max_tokens, n, seed, logprobs, rep, presence, frequency, stop,
    stop_ids,
):  # fmt: skip
    p = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, n=n,
        seed=seed, logprobs=logprobs, repetition_penalty=rep, presence_penalty=presence,
        frequency_penalty=frequency, stop=stop, stop_token_ids=stop_ids,
    )  # fmt: skip
    assert p.stop == tuple(stop) and p.top_k == max(top_k, 0)
    _use_sampling(p)


def test_the_issues_examples():
    with pytest.raises(TypeError, match=r"SamplingParams.stop=\[1\] must be a string or a list"):
        SamplingParams(stop=[1])
    with pytest.raises(TypeError, match="stop_token_ids=7 must be a list"):
        SamplingParams(stop_token_ids=7)
    with pytest.raises(ValueError, match=r"min_tokens=9 must be <= max_tokens=4"):
        SamplingParams(min_tokens=9, max_tokens=4)
    with pytest.raises(
        ValueError, match=r"presence_penalty=3 must be a finite number in \[-2, 2\]"
    ):
        SamplingParams(presence_penalty=3)
    # a TypeError is also a ValueError: code catching ValueError for bad arguments still works
    with pytest.raises(ValueError):
        SamplingParams(temperature="hot")


@QUICK
@given(field=st.sampled_from(CONFIG_FIELDS), value=ANY, model_top_k=st.sampled_from([16, 2048]))
def test_each_hisparse_config_field(field, value, model_top_k):
    try:
        cfg = HiSparseConfig(**{field: value})
        resolved = cfg.resolve(model_top_k=model_top_k)
    except Exception as err:
        _names(err, field)
        return
    assert resolved.device_buffer_size >= resolved.top_k * resolved.max_query_len


@QUICK
@given(st.fixed_dictionaries({}, optional=dict.fromkeys(CONFIG_FIELDS, ANY)))
def test_any_hisparse_config(kwargs):
    try:
        HiSparseConfig(**kwargs).resolve(model_top_k=16)
    except Exception as err:
        _names(err, *kwargs, "top_k")


#: LLM arguments: values that may work for the tiny checkpoint, then values that must not.
LLM_VALUES = {
    "kv_placement": ["hisparse", "gpu", "disk"],
    "max_num_seqs": [1, 3, 4096, 4097, 0],
    "max_model_len": [None, 2, 37, 128, 4097, 1],
    "gpu_memory_gib": [0.05, 1e-6, 0, -1.0, 1e6],
    "dtype": ["auto", "float32", "bf16", "half", torch.float16, torch.int8, "int8"],
    "device": [None, "cpu", torch.device("cpu"), "cuda:7", "tpu", 0],
    "kv_format": [*KV_FORMATS, "fp16"],
    "indexer": ["fp8", "exact", "quest"],
    "max_num_batched_tokens": [1, 7, 2**62, 0],
    "step_hooks": [None, StepHooks(), 3],
    "cuda_graphs": [None, False, True],
    "schedule": ["mixed", "prefill-first", "fifo"],
}
#: Wrong for every argument (types, NaN, infinities, huge and negative numbers).
BAD = [True, 1.5, float("nan"), float("inf"), "x", [1], {}, object(), 2**70, -(2**70)]
CONFIGS = st.builds(
    HiSparseConfig,
    top_k=st.sampled_from([None, 1, 3, 16, 64]),
    device_buffer_size=st.sampled_from([None, 16, 40, 32768]),
    host_pool_gib=st.sampled_from([None, 0.01, 1e-6]),
    block_size=st.sampled_from([1, 3, 4, 16, 64, 4096]),
    eager_host_mirror=st.booleans(),
    max_query_len=st.sampled_from([1, 2]),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_llm_arguments(checkpoint, data):
    """One argument drawn (a value that may work or one that must not), the others the small
    test settings. A failed construction leaves no host pool behind; a built engine runs."""
    field = data.draw(st.sampled_from([*LLM_VALUES, "hisparse"]), label="field")
    if field == "hisparse":
        value = data.draw(CONFIGS | st.sampled_from([None, {"top_k": 4}, 3]), label="value")
    else:
        value = data.draw(st.sampled_from(LLM_VALUES[field] + BAD), label="value")
    try:
        llm = LLM(checkpoint, **{**TINY_LLM, field: value})
    except Exception as err:
        if field == "hisparse" and isinstance(value, HiSparseConfig):
            _names(err, *CONFIG_FIELDS, "max_model_len", "gpu_memory_gib")
        else:
            _names(err, field)
        assert live_pool() is None
        return
    with llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts((5, 12)), sampling_params=params)
        if llm.max_model_len > 12:
            assert all(o.ok and len(o.token_ids) == 3 for o in outs), [o.error for o in outs]
    assert live_pool() is None


GOOD_PROMPT = st.lists(st.integers(0, 511), min_size=1, max_size=30)
# (a bare int is no bad prompt here: a list of ints is one prompt, so [5] would be valid)
BAD_PROMPT = st.sampled_from(
    [[], [512], [-1], [3, 10**20], ["7"], [1.0], [True], [None], None, "text", list(range(128)),
     list(range(200)), [[1, 2]], {"ids": [1]}]
)  # fmt: skip


def test_a_batch_with_a_prompt_that_can_never_run_raises_before_anything_runs(checkpoint):
    """vLLM's behaviour: a prompt the engine can never run (bad ids, empty, no room under
    max_model_len) is a `ValueError` naming it, and nothing of the call is queued."""
    with tiny_llm(checkpoint) as llm:

        @settings(max_examples=25, deadline=None)
        @given(
            batch=st.lists(st.tuples(st.booleans(), GOOD_PROMPT, BAD_PROMPT), min_size=1,
                           max_size=5),
            lengths=st.lists(st.integers(1, 4), min_size=5, max_size=5),
            n=st.sampled_from([1, 2]),
        )  # fmt: skip
        def check(batch, lengths, n):
            ids = [good if ok else bad for ok, good, bad in batch]
            params = [
                SamplingParams(temperature=0.7, seed=i, max_tokens=m, ignore_eos=True, n=n)
                for i, m in zip(range(len(ids)), lengths, strict=False)
            ]
            bad = [i for i, (ok, _, _) in enumerate(batch) if not ok]
            if bad:
                where = f"prompt {bad[0]} (of {len(ids)}): " if len(ids) > 1 else ""
                with pytest.raises(ValueError, match=re.escape(where) or None) as err:
                    llm.generate(prompt_token_ids=ids, sampling_params=params)
                assert "nothing was run" in str(err.value)
            else:
                outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
                for p, out in zip(params, outs, strict=True):
                    assert len(out.outputs) == n and out.ok, out.error
                    assert all(len(c.token_ids) == p.max_tokens for c in out.outputs)
            kv = llm.kv
            assert not llm.scheduler.waiting and not llm.scheduler.running and not kv.requests
            assert kv.host_blocks.num_free == kv.host_blocks.num_usable

        check()


def test_bad_calls_fail_before_anything_runs(checkpoint):
    with tiny_llm(checkpoint, kv_placement="gpu") as llm:
        with pytest.raises(TypeError, match="prompts=5 must be a string"):
            llm.generate(5)
        with pytest.raises(TypeError, match="prompt_token_ids=7 must be a list of token ids"):
            llm.generate(prompt_token_ids=7)
        with pytest.raises(TypeError, match=r"sampling_params\[1\]=3 must be a SamplingParams"):
            llm.generate(prompt_token_ids=[[1], [2]], sampling_params=[SamplingParams(), 3])
        with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
            llm.generate(prompt_token_ids=[[1], [2]], sampling_params=[SamplingParams()])
        with pytest.raises(ValueError, match="exactly one of prompts or prompt_token_ids"):
            llm.generate()
        # text without a tokenizer, or a prompt of no known shape, can never run
        with pytest.raises(ValueError, match=r"prompt 0 \(of 3\): this checkpoint has no "):
            llm.generate(["hello", {"prompt_token_ids": [3, 4]}, 7], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"prompt 1 \(of 2\): a prompt must be a string"):
            llm.generate([{"prompt_token_ids": [3, 4]}, 7], SamplingParams(max_tokens=2))
        assert not llm.scheduler.waiting and not llm.kv.requests
        assert llm.generate([]) == []


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--max-tokens", "0"], "--max-tokens 0: must be a positive integer, e.g. "
         "--max-tokens 16"),
        (["generate", "--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
        (["generate", "--host-pool-gib", "-1"], "--host-pool-gib -1.0: must be a positive"),
        (["generate", "--top-k", "0"], "--top-k 0: must be a positive integer"),
        (["generate", "--seed", "-1"], "--seed -1: must be a non-negative integer"),
        (["generate", "--max-model-len", "1"], "--max-model-len 1: must be an integer >= 2"),
        (["generate", "--device", "tpu"], "--device tpu: must be 'cpu' or 'cuda[:N]'"),
        (["plan", "--model", "deepseek-v3.2", "--gpu-memory-gib", "1", "--host-pool-gib", "4",
          "--max-model-len", "8192", "--block-size", "0"], "--block-size 0: must be a positive"),
    ],
)  # fmt: skip
def test_cli_flags_are_checked_and_named(capsys, argv, needle):
    from hisparse.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--dtype", "int8"], "--dtype int8: must be 'auto', 'float32'"),
        (["--kv-format", "fp16"], "--kv-format fp16: must be one of 'auto', 'fp8_ds_mla'"),
        (["--kv-format", "fp8_ds_mla"], "kv_format='fp8_ds_mla' gives rows of 164 bytes"),
        (["--block-size", "5000"], "--block-size 5000: must be a positive integer <= 4096"),
        (["--seed", "-4"], "--seed -4: must be a non-negative integer"),
    ],
)
def test_bench_flags_are_checked_and_named(checkpoint, capsys, extra, needle):
    from hisparse.cli import main

    argv = ["bench", "--model", str(checkpoint), "--input-len", "10", "--output-len", "4",
            "--gpu-memory-gib", "0.02", "--kv-placement", "gpu", *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_python_dash_m_hisparse_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "hisparse", "--help"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "generate" in out.stdout and "plan" in out.stdout
