"""Faults are contained (issue #49): each injected fault fails only its request (a step that
raises: the requests of that step), the engine goes on, every block comes back; a step that
keeps failing stops the server with exit status 1 instead of hanging with ``/health`` 200;
a client that hangs up, streamed or not, is aborted within a step and the gauges show it at
once; the deadline aborts; every error is OpenAI's JSON shape (a text prompt on a checkpoint
without a tokenizer: 400).

Real uvicorn servers on 127.0.0.1 (any free port) over the bundled SmolLM2 on the CPU, one per
test over one engine; every request has a timeout."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM

pytest.importorskip("uvicorn")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

from hisparse.serve.background import serve_in_thread  # noqa: E402 (needs uvicorn)

TIMEOUT = 60.0
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        "smollm2",
        kv_placement="hisparse",
        hisparse=HiSparseConfig(host_pool_gib=0.25, offload="always"),
        max_model_len=512,
        max_num_seqs=4,
        gpu_memory_gib=0.25,
        device="cpu",
    )
    yield engine
    engine.close()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _idle(llm) -> bool:
    """Nothing queued or admitted, and every host and GPU block back in its pool."""
    kv, sched = llm.kv, llm.scheduler
    host_ok = kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
    return (
        not sched.waiting
        and not sched.running
        and not kv.requests
        and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        and host_ok
    )


def _wait(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> float:
    """Poll ``pred`` until true; the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "model", **body}, timeout=TIMEOUT)


def _stream_events(url: str, path: str, body: dict, on_chunk=None) -> list[dict | str]:
    """Every event of a stream (``[DONE]`` as a string); ``on_chunk(k)`` after the k-th."""
    events: list[dict | str] = []
    with httpx.stream("POST", url + path, json={"model": "model", "stream": True, **body},
                      timeout=TIMEOUT) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if on_chunk is not None:
                    on_chunk(len(events))
    return events


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return err


def _assert_failed_stream(events: list, code: str, reason: str = "error") -> dict:
    """A stream that failed after it started: chunks, a final chunk, the error, [DONE]."""
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == code and err["type"] == "server_error", err
    finals = [c["choices"][0]["finish_reason"] for c in events[:-2] if c["choices"]]
    assert finals[-1] == reason and finals.count(reason) == 1, finals
    return err


def _healthy_after(url: str, llm) -> None:
    _wait(lambda: _idle(llm), "every block back")
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    r = _post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    _wait(lambda: _idle(llm), "every block back")
    m = _metrics(url)
    assert m["hisparse:num_requests_running"] == 0 == m["hisparse:num_requests_waiting"]


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    fail_next = threading.Event()
    real = llm.step

    def step():
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected step fault")
        return real()

    monkeypatch.setattr(llm, "step", step)
    with serve_in_thread(llm) as srv:
        fail_next.set()  # the request's first step fails: a JSON 500, before any token
        r = _post(srv.url, "/v1/completions", {"prompt": "Hello", **LONG})
        err = _error(r, 500, "engine_step_failed")
        assert "injected step fault" in err["message"]
        # a stream that already started: its final chunk, the error event, [DONE]
        events = _stream_events(
            srv.url,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello"}], **LONG},
            on_chunk=lambda k: k == 3 and fail_next.set(),
        )
        _assert_failed_stream(events, "engine_step_failed")
        assert srv.engine.error is None
        _healthy_after(srv.url, llm)
        assert srv.engine.step_failures == 0


def test_a_request_whose_logits_are_not_finite_fails_alone(llm, monkeypatch):
    """The engine's own per-request fault (a row without a distribution) reaches its client
    as a 500 (or a stream's error event); the request beside it finishes."""
    run = llm.runner.run

    def poisoned(*args, **kwargs):
        result = run(*args, **kwargs)
        for row, req in enumerate(result.sample_reqs):
            if req.params.seed == 4242 and len(req.output_token_ids) >= 3:
                result.logits[row] = float("nan")
        return result

    monkeypatch.setattr(llm.runner, "run", poisoned)
    with serve_in_thread(llm) as srv, ThreadPoolExecutor(2) as pool:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
        victim = pool.submit(_post, srv.url, "/v1/completions", {**body, "seed": 4242})
        bystander = pool.submit(_post, srv.url, "/v1/completions", {**body, "seed": 1})
        err = _error(victim.result(TIMEOUT), 500, "request_failed")
        assert "not finite" in err["message"]
        ok = bystander.result(TIMEOUT)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12
        events = _stream_events(srv.url, "/v1/completions", {**body, "seed": 4242})
        _assert_failed_stream(events, "request_failed")
        _healthy_after(srv.url, llm)


def test_a_request_the_engine_cannot_queue_fails_alone(llm, monkeypatch):
    add = llm.add_request

    def add_request(ids, params, **kwargs):
        if params.seed == 999:
            raise RuntimeError("injected add fault")
        return add(ids, params, **kwargs)

    monkeypatch.setattr(llm, "add_request", add_request)
    with serve_in_thread(llm) as srv:
        r = _post(srv.url, "/v1/completions", {"prompt": "Hi", "seed": 999, "max_tokens": 2})
        assert "injected add fault" in _error(r, 500, "internal_error")["message"]
        _healthy_after(srv.url, llm)


def test_a_step_that_keeps_failing_stops_the_server_with_status_1(llm, monkeypatch):
    def step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm, "step", step)
    with serve_in_thread(llm) as srv:
        codes = []
        for _ in range(srv.engine.max_step_failures):
            r = _post(srv.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            codes.append(_error(r, 500, r.json()["error"]["code"])["code"])
        assert codes == ["engine_step_failed"] * (len(codes) - 1) + ["engine_failed"]
        assert srv.engine.error is not None
        _wait(lambda: not srv.thread.is_alive(), "the server stops")  # never /health 200
        assert srv.state.exit_code == 1
    assert _idle(llm)


def test_a_non_streaming_client_that_hangs_up_is_aborted_within_a_step(llm):
    with serve_in_thread(llm) as srv:
        before = _metrics(srv.url).get("hisparse:request_aborted_total", 0.0)
        body = json.dumps({"prompt": "Tell me a long story.", **LONG}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _wait(lambda: _metrics(srv.url).get("hisparse:generation_tokens_total", 0) >= 2,
              "the request runs")  # fmt: skip
        assert _metrics(srv.url)["hisparse:num_requests_running"] == 1
        steps = len(llm.step_stats)
        sock.close()
        _wait(lambda: _metrics(srv.url)["hisparse:num_requests_running"] == 0, "abort", 10)
        assert len(llm.step_stats) - steps <= 2  # the step in flight, at most one more
        assert _idle(llm)
        m = _metrics(srv.url)
        assert m["hisparse:request_aborted_total"] == before + 1
        assert m["hisparse:generation_tokens_total"] < 400


def test_a_cancelled_stream_leaves_the_gauges_at_once(llm):
    """No other request arrives after the hang-up: the gauges still drop (they used to be
    updated only after a step)."""
    with serve_in_thread(llm) as srv:
        body = {"model": "model", "prompt": "Tell me a long story.", "stream": True, **LONG}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                          timeout=TIMEOUT) as r:  # fmt: skip
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the first chunk
            assert _metrics(srv.url)["hisparse:num_requests_running"] == 1
        _wait(lambda: _metrics(srv.url)["hisparse:num_requests_running"] == 0, "abort", 10)
        m = _metrics(srv.url)
        assert m["hisparse:gpu_pool_blocks_used"] == 0 == m["hisparse:host_pool_blocks_used"]
        assert _idle(llm)


def test_the_deadline_aborts_and_frees_a_request(llm):
    with serve_in_thread(llm, request_timeout=1.0) as srv:
        t0 = time.monotonic()
        r = _post(srv.url, "/v1/completions", {"prompt": "Tell me a story.", **LONG})
        assert "--request-timeout" in _error(r, 504, "request_timeout")["message"]
        assert time.monotonic() - t0 < 10
        chat = {"messages": [{"role": "user", "content": "Hi"}], **LONG}
        events = _stream_events(srv.url, "/v1/chat/completions", chat)
        _assert_failed_stream(events, "request_timeout", reason="abort")
        _wait(lambda: _idle(llm), "every block back")


def test_every_error_is_openai_shaped_json(llm, monkeypatch):
    def broken(messages):
        raise RuntimeError("template engine exploded")

    with serve_in_thread(llm) as srv:
        _error(httpx.get(srv.url + "/v2/nothing", timeout=TIMEOUT), 404, "not_found")
        _error(httpx.get(srv.url + "/v1/completions", timeout=TIMEOUT), 405,
               "method_not_allowed")  # fmt: skip
        monkeypatch.setattr(llm, "chat_token_ids", broken)
        r = _post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert "exploded" in _error(r, 500, "internal_error")["message"]


def test_a_text_prompt_without_a_tokenizer_is_a_json_400(tmp_path_factory):
    pytest.importorskip("transformers")
    from hisparse.models.tiny import make_tiny

    path = make_tiny("deepseek_v32", tmp_path_factory.mktemp("v32"), seed=0)
    # all-GPU placement: no host pool beside the module's (one per process)
    tiny = LLM(path, kv_placement="gpu", hisparse=HiSparseConfig(block_size=4),
               max_model_len=128, max_num_seqs=2, gpu_memory_gib=0.02)  # fmt: skip
    assert tiny.tokenizer is None
    try:
        with serve_in_thread(tiny) as srv:
            for path_, body in [
                ("/v1/completions", {"prompt": "hello"}),
                ("/v1/completions", {"prompt": "hello", "stream": True}),
                ("/tokenize", {"prompt": "hello"}),
            ]:
                err = _error(_post(srv.url, path_, body), 400, "no_tokenizer")
                assert err["param"] == "prompt" and "tokenizer" in err["message"]
            err = _error(_post(srv.url, "/detokenize", {"tokens": [1, 2]}), 400, "no_tokenizer")
            r = _post(srv.url, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hello"}]})  # fmt: skip
            assert _error(r, 400, "invalid_request")["param"] == "messages"
            r = _post(srv.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        tiny.close()
