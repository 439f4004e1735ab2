"""Prefix caching through `hisparse serve` (docs/design.md §12.10): two requests over one
2K-token document of real text, sent with the `openai` client to a real server (SmolLM2,
HiSparse placement): the second prefills only its question, reports the document as
``usage.prompt_tokens_details.cached_tokens``, answers what an engine without the cache
answers, and `/metrics` counts the cached tokens."""

from __future__ import annotations

import socket
import threading
import time
from pydoc_data.topics import topics

import httpx
import pytest

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

from hisparse.serve.server import make_server  # noqa: E402 (needs uvicorn)

DOC_TOKENS = 2048
TEXT = "\n\n".join(topics[k] for k in ("for", "while", "if", "try", "with", "class", "function"))


def _llm(caching: bool) -> LLM:
    return LLM(
        "smollm2",
        kv_placement="hisparse",
        hisparse=HiSparseConfig(top_k=96, host_pool_gib=0.25),
        max_model_len=2304,
        max_num_seqs=2,
        gpu_memory_gib=0.25,
        device="cpu",
        enable_prefix_caching=caching,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_shared_2k_document_is_prefilled_once_over_http():
    with _llm(False) as plain:
        doc = plain.encode(TEXT)[:DOC_TOKENS]
        assert len(doc) == DOC_TOKENS
        first = doc + plain.encode(" Summarize the for statement.", add_special_tokens=False)
        second = doc + plain.encode(" What does try do?", add_special_tokens=False)
        greedy = SamplingParams(temperature=0, max_tokens=4)
        want = plain.generate(prompt_token_ids=[second], sampling_params=greedy)[0]
        assert want.ok and want.metrics.cached_tokens == 0
    llm = _llm(True)
    port = _free_port()
    srv, state = make_server(llm, model_name="smollm2", host="127.0.0.1", port=port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start within 60 s"
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", timeout=300, max_retries=0)
        outs = [
            client.completions.create(model="smollm2", prompt=p, max_tokens=4, temperature=0)
            for p in (first, second)
        ]
        assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
        assert outs[1].usage.prompt_tokens == len(second)
        assert outs[1].usage.prompt_tokens_details.cached_tokens >= 1900
        assert outs[1].choices[0].text == want.text
        metrics = httpx.get(f"{base}/metrics", timeout=60).text
        hits = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("hisparse:prefix_cache_hits_total")
        )
        assert hits == outs[1].usage.prompt_tokens_details.cached_tokens
    finally:
        srv.should_exit = True
        thread.join(30)
        state.engine.shutdown()
        llm.close()
