"""MTP speculative decoding (`engine.mtp_drafts`) on tiny DSA checkpoints with an MTP layer.

Lossless: greedy tokens with MTP drafts equal those without, for DeepSeek-V3.2 and GLM-5, in
both placements and both offload policies, with drafts the MTP layer makes (the tiny layer is
random: they are refused) and with the MTP layer's drafts replaced by the known continuation
after it ran (all accepted: its rows of accepted drafts are then what later drafts read), with
chunked prompts and preemption; every block returns to the pools. The drafts themselves are
checked against a dense reference: the MTP layer over the whole sequence at once
(`DenseDsaCache`), so rows written in pieces across prefill chunks, verifying steps and
rewrites read as rows written in one go.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.testing.mtp import check_drafts, watch_drafts
from hisparse.validation import HiSparseConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [[(7 * i + 3 * j) % 240 + 8 for j in range(n)] for i, n in enumerate((37, 22, 61))]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param, mtp=True)


_PLAIN: dict[tuple[str, int], list[list[int]]] = {}


def _run(path, placement="gpu", *, spec=None, params=GREEDY, prompts=PROMPTS, accept=None,
         seen=None, tokens=2048, requests=None, **hs):  # fmt: skip
    """Generate; ``seen`` collects (tokens up to the step's input, the MTP layer's drafts);
    ``accept``: the plain outputs, whose continuation then replaces the drafts (all taken).
    ``requests``: a GPU pool of that many max_model_len requests at their peak."""
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, **hs)
    kw = dict(kv_placement=placement, hisparse=cfg, kv_format="bf16", max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=tokens, speculative_config=spec)  # fmt: skip
    gib = 0.02
    if requests is not None:
        with LLM(path, gpu_memory_gib=gib, **kw) as probe:
            lay = probe.kv.layout
            n = 1 + int(requests * lay.gpu_blocks_per_request(lay.max_model_len))
            gib = (n * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    with LLM(path, gpu_memory_gib=gib, **kw) as llm:
        if spec is not None:
            watch_drafts(llm, seen, accept, prompts)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        kv = llm.kv
        assert not kv.requests and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        assert kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
        model = llm.model
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs, model


def _plain(path, **kw):
    key = (str(path), kw.get("params", GREEDY).max_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = [o.token_ids for o in _run(path, **kw)[0]]
    return _PLAIN[key]


@pytest.mark.parametrize(
    "placement,offload", [("gpu", None), ("hisparse", None), ("hisparse", "always")]
)
def test_mtp_gives_the_plain_tokens(checkpoint, placement, offload):
    """The MTP layer's own drafts (refused: a random layer) give the plain tokens; the drafts
    are the dense reference's."""
    want = _plain(checkpoint)
    seen: list = []
    outs, model = _run(checkpoint, placement, spec=MTP, seen=seen, offload=offload)
    assert [o.token_ids for o in outs] == want
    m = [o.metrics for o in outs]
    # refused MTP drafts do not pause: every decode step after the first drafts
    assert all(x.spec_steps == x.decode_steps - 1 > 0 for x in m), m
    check_drafts(model, seen[::4])
    if offload == "always":
        assert sum(o.metrics.misses for o in outs) > 0


def test_mtp_rows_of_accepted_drafts(checkpoint):
    """Drafts replaced by the continuation (all taken) with the lazy host mirror: the plain
    tokens, the acceptance metrics, and MTP drafts that still match the reference (its rows
    written beside accepted drafts are right). The first request's ``max_tokens`` caps its
    drafts, so steps mix a request without drafts and requests with several."""
    want = _plain(checkpoint)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seen: list = []
    outs, model = _run(checkpoint, "hisparse", spec=MTP, seen=seen, accept=want,
                       params=[short, GREEDY, GREEDY], eager_host_mirror=False)  # fmt: skip
    assert [o.token_ids for o in outs] == [want[0][:6], *want[1:]]
    m = [o.metrics for o in outs]
    assert all(x.spec_accepted == x.spec_drafted > 0 for x in m)
    assert all(x.acceptance_rate == 1.0 and x.mean_accepted_length > 2 for x in m)
    check_drafts(model, seen)


def test_mtp_chunked_prompts_and_preemption(checkpoint):
    """Chunks of 16 tokens beside verifying steps in a pool so tight that requests are
    preempted and recomputed (their MTP rows too): the plain tokens, drafts as the
    reference's."""
    long = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[0][:30]]
    ref = [o.token_ids for o in _run(checkpoint, params=long, prompts=prompts, top_k=4)[0]]
    seen: list = []
    outs, model = _run(checkpoint, "hisparse", spec=MTP, params=long, prompts=prompts,
                       accept=ref, seen=seen, tokens=16, top_k=4, offload="always",
                       requests=1.5)  # fmt: skip
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == ref
    check_drafts(model, seen[::5])


def test_mtp_with_prefix_cache_hits_and_seeded_sampling(tiny_checkpoint):
    """The same prompts again (their pages from the prefix cache, MTP rows included) and
    seeded sampled requests with a penalty: the tokens without speculation, drafts as the
    reference's (GLM-5: IndexShare). (Stops inside accepted drafts are the verifier's, tested
    with n-gram drafts in test_speculative.py.)"""
    checkpoint = tiny_checkpoint("glm_moe_dsa", mtp=True)
    sampled = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True,
                              presence_penalty=0.3 * i) for i in range(3)]  # fmt: skip
    want = [o.token_ids for o in _run(checkpoint, params=sampled)[0]]
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4)
    seen: list = []
    with LLM(checkpoint, hisparse=cfg, kv_format="bf16", max_model_len=128, max_num_seqs=4,
             gpu_memory_gib=0.02, speculative_config=MTP) as llm:  # fmt: skip
        watch_drafts(llm, seen, None, PROMPTS)
        first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        again = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sampled)
        model = llm.model
    plain = _plain(checkpoint)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == plain
    assert all(o.metrics.cached_tokens > 0 for o in again)
    assert [o.token_ids for o in got] == want
    check_drafts(model, seen[::3])


def test_mtp_needs_the_checkpoints_mtp_layer(tiny_checkpoint):
    from hisparse.engine.speculative import SpeculativeConfig
    from hisparse.models.registry import engine_specs

    # a model with no `mtp` layers (a GGUF Llama): refused before its specs are made
    with pytest.raises(HiSparseConfigError, match="num_nextn_predict_layers = 0"):
        engine_specs(torch.nn.Module(), None, 4, spec=SpeculativeConfig(method="mtp"))
    with pytest.raises(HiSparseConfigError, match="num_nextn_predict_layers"):
        LLM(tiny_checkpoint("deepseek_v32"), speculative_config=MTP, gpu_memory_gib=0.02,
            max_model_len=64)  # fmt: skip


def test_generate_cli_with_mtp_on_the_releases_fp8_format(tiny_checkpoint, capsys):
    """``hisparse generate --speculative-config`` on a checkpoint in the releases' fp8
    format (its MTP layer's projections kept fp8): the plain text, and the drafts reported."""
    from hisparse.cli import main

    path = tiny_checkpoint("glm_moe_dsa", fp8=True)
    args = ["generate", "--model", str(path), "--prompt", "hello there, hello there, hello",
            "--max-tokens", "10", "--no-chat", "--max-model-len", "128",
            "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    plain = capsys.readouterr().out
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert main([*args, "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert _answer(out) == _answer(plain) and "drafts accepted" in out


def _answer(out: str) -> str:
    return out[out.index("Answer:") : out.index(" tokens, decode")]


def test_serve_with_mtp_streams_the_plain_text(tiny_checkpoint):
    """``hisparse serve --speculative-config '{"method": "mtp", ...}'``'s server: a completion
    streamed over the ``openai`` client is the plain greedy text; ``/metrics`` counts drafts."""
    import socket
    import threading
    import time

    import httpx

    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from hisparse.serve.server import make_server

    path = tiny_checkpoint("deepseek_v32", fp8=True)
    prompt, kw = "hello there, hello there, hello", dict(max_model_len=128, max_num_seqs=2)
    with LLM(path, **kw) as plain:
        want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].text
    llm = LLM(path, speculative_config=MTP, **kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv, state = make_server(llm, model_name="tiny", host="127.0.0.1", port=port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start within 60 s"
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True)  # fmt: skip
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert text == want and text
        metrics = httpx.get(f"{base}/metrics", timeout=60).text
        assert "hisparse:spec_decode_num_draft_tokens_total" in metrics
        drafted = [ln for ln in metrics.splitlines()
                   if ln.startswith("hisparse:spec_decode_num_draft_tokens_total")]  # fmt: skip
        assert float(drafted[0].split()[-1]) > 0
    finally:
        srv.should_exit = True
        thread.join(30)
        state.engine.shutdown()
        llm.close()


def test_mtp_beside_a_structured_output(tiny_checkpoint):
    """A request with a grammar drafts nothing while the one beside it drafts: both get the
    outputs they get without speculation."""
    from hisparse.engine.structured_params import StructuredOutputsParams

    pytest.importorskip("xgrammar")
    path = tiny_checkpoint("glm_moe_dsa", fp8=True)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]  # fmt: skip
    got = []
    for spec in (None, MTP):
        with LLM(path, max_model_len=128, max_num_seqs=2, speculative_config=spec) as llm:
            outs = llm.generate(["hello there hello there", "abc abc abc abc"], params)
        got.append([(o.text, o.token_ids) for o in outs])
        assert all(o.ok for o in outs)
    assert got[0] == got[1] and got[1][0][0] in choice.choice
    assert outs[0].metrics.spec_drafted == 0 < outs[1].metrics.spec_drafted
