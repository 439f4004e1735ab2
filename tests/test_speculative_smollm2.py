"""Speculative decoding with n-gram drafts on the real SmolLM2 weights (CPU): greedy tokens
equal those without speculation in both placements (HiSparse reading every older row through
its hot buffer, which the verifying rows share), with drafts really accepted, the verify
steps through the CPU rows path (`llama_cpu_rows`), each of whose rows with the plain run's
inputs has the one-row step's final hidden state and logprobs bit for bit when its matmuls run
row by row (to rounding with the default one matmul); and
``hisparse serve`` with ``--speculative-config`` streams the same greedy text over HTTP
(the `openai` client), its ``/metrics`` counting the drafts."""

from __future__ import annotations

import socket
import threading
import time
from pydoc_data.topics import topics

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.models import llama, llama_cpu_rows

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

from hisparse.serve.server import make_server  # noqa: E402 (needs uvicorn)

TOP_K = 96  # below the ~250-token prompt: selections are scored, rows swapped in
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
#: an input-grounded request: the answer copies the prompt, so prompt lookup finds drafts
PROMPT = "Repeat this passage exactly:\n\n" + topics["for"][:700]
GREEDY = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
TIMEOUT = 120.0


class Recorder:
    """Wraps a model's forward: each call's positions, input ids, final hidden states and
    whether it was a verify step."""

    def __init__(self, llm: LLM) -> None:
        self.calls: list[tuple[list[int], list[int], torch.Tensor, bool]] = []
        model = llm.model
        inner = model.forward

        def forward(input_ids, step, cache):
            h = inner(input_ids, step, cache)
            rec = (step.positions.tolist(), input_ids.tolist(), h.clone(), step.verify)
            self.calls.append(rec)
            return h

        model.forward = forward

    def rows(self) -> dict[int, tuple[int, torch.Tensor]]:
        """Position -> (input id, final hidden state) of every row (a plain run's)."""
        return {
            p: (i, h[t])
            for pos, ids, h, _ in self.calls
            for t, (p, i) in enumerate(zip(pos, ids, strict=True))
        }


def _llm(placement: str, spec=None) -> LLM:
    return LLM(
        "smollm2",
        kv_placement=placement,
        hisparse=HiSparseConfig(top_k=TOP_K, host_pool_gib=0.25, offload="always"),
        max_model_len=1024,
        max_num_seqs=2,
        gpu_memory_gib=0.25,
        device="cpu",
        speculative_config=spec,
    )


@pytest.fixture(scope="module")
def plain():
    """The run without speculation: (prompt token ids, output, every row's input id and
    final hidden state by position)."""
    with _llm("hisparse") as llm:
        ids = llm.chat_token_ids([{"role": "user", "content": PROMPT}])
        assert len(ids) > 2 * TOP_K
        rec = Recorder(llm)
        (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
    assert out.ok
    return ids, out, rec.rows()


def test_ngram_gives_the_plain_tokens_in_both_placements(plain, monkeypatch):
    """Both placements with the verify step's matmuls row by row (``ROWWISE_MATMUL``): every
    row with the plain run's inputs has its hidden state and logprobs bit for bit; HiSparse
    with the default (one matmul over the rows): the plain tokens, logprobs to rounding."""
    ids, want, rows = plain
    ran = []
    fast = llama.decode_rows_cpu
    monkeypatch.setattr(llama, "decode_rows_cpu", lambda *a: ran.append(1) or fast(*a))
    for placement, rowwise in (("gpu", True), ("hisparse", True), ("hisparse", False)):
        ran.clear()
        monkeypatch.setattr(llama_cpu_rows, "ROWWISE_MATMUL", rowwise)
        with _llm(placement, SPEC) as llm:
            rec = Recorder(llm)
            (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
            kv = llm.kv
            assert kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        assert out.token_ids == want.token_ids, placement
        got_lp, want_lp = out.outputs[0].logprobs, want.outputs[0].logprobs
        assert got_lp is not None and want_lp is not None
        for g, w in zip(got_lp, want_lp, strict=True):
            assert list(g) == list(w)
            assert max(abs(g[t] - w[t]) for t in g) <= (0.0 if rowwise else 1e-4)
        # every verify step took the CPU rows path; each of its rows whose inputs so far are
        # the plain run's (the last token, then accepted drafts) equals that run's row
        verify = [c for c in rec.calls if c[3]]
        assert len(ran) == len(verify) == out.metrics.spec_steps > 0, placement
        compared = 0
        for pos, step_ids, h, _ in verify:
            for t, p in enumerate(pos):
                if any(rows[q][0] != i for q, i in zip(pos[: t + 1], step_ids, strict=False)):
                    break
                if rowwise:
                    assert torch.equal(h[t], rows[p][1]), (placement, p)
                else:
                    torch.testing.assert_close(h[t], rows[p][1], rtol=1e-4, atol=1e-4)
                compared += 1
        assert compared > len(verify)  # drafts' rows too, not only each step's first
        m = out.metrics
        assert m.spec_accepted > 0 and m.decode_steps < want.metrics.decode_steps
        assert m.mean_accepted_length > 1 and 0 < m.acceptance_rate <= 1
        if placement == "hisparse":
            assert m.misses > 0  # rows really came through the hot buffer


def test_serve_with_speculation_streams_the_plain_text(plain):
    _, want, _ = plain
    llm = _llm("hisparse", SPEC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv, state = make_server(llm, model_name="smollm2", host="127.0.0.1", port=port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start within 60 s"
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=TIMEOUT,
                               max_retries=0)  # fmt: skip
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": PROMPT}],
            max_tokens=GREEDY.max_tokens, temperature=0, stream=True,
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want.text and text
        metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
        seen = {
            s.name: s.value for fam in text_string_to_metric_families(metrics) for s in fam.samples
        }
        assert seen["hisparse:spec_decode_num_accepted_tokens_total"] > 0
        assert (
            seen["hisparse:spec_decode_num_draft_tokens_total"]
            >= seen["hisparse:spec_decode_num_accepted_tokens_total"]
        )
    finally:
        srv.should_exit = True
        thread.join(30)
        state.engine.shutdown()
        llm.close()
