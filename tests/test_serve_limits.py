"""Every request is bounded before it is accepted (issue #49): ``n`` / ``best_of`` above the
cap and requests whose sequences can never fit the queue get a 400 naming the field; one that
arrives while the queue is full gets a 503 with ``Retry-After``; a large fan-out does not
starve a later request; `SamplingParams` refuses the same things in the Python API.

A real uvicorn server on 127.0.0.1 (any free port) with the bundled SmolLM2 on the CPU,
driven by httpx and the official ``openai`` client; every request has a timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from hisparse import HiSparseConfig, SamplingParams
from hisparse.engine.llm import LLM
from hisparse.engine.sampling_params import MAX_N

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

from hisparse.serve.background import serve_in_thread  # noqa: E402 (needs uvicorn)

TIMEOUT = 60.0
QUEUE = 4  # --max-waiting of these servers: sequences queued, not yet running
ROUTES = [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        "smollm2",
        kv_placement="hisparse",
        hisparse=HiSparseConfig(host_pool_gib=0.25),
        max_model_len=512,
        max_num_seqs=4,
        gpu_memory_gib=0.25,
        device="cpu",
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def srv(llm):
    with serve_in_thread(llm, model_name="smollm2", max_waiting=QUEUE) as running:
        yield running


def _post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "smollm2", "max_tokens": 2, **body},
                      timeout=TIMEOUT, **kw)  # fmt: skip


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


def _idle(llm) -> bool:
    kv, sched = llm.kv, llm.scheduler
    host_ok = kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
    return (
        not sched.waiting
        and not sched.running
        and not kv.requests
        and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        and host_ok
    )


@contextmanager
def engine_held(llm) -> Iterator[threading.Event]:
    """Hold the engine loop at its next step (until the block ends): what was queued stays
    queued. Yields the event set once the loop is held."""
    entered, release = threading.Event(), threading.Event()
    real = llm.step

    def step():
        entered.set()
        release.wait(TIMEOUT)
        return real()

    llm.step = step
    try:
        yield entered
    finally:
        release.set()
        del llm.step


_NEVER = [
    ({"n": MAX_N + 1}, "n", "n_too_large"),
    ({"n": 1_000_000}, "n", "n_too_large"),
    ({"n": QUEUE + 1}, "n", "too_many_sequences"),  # within the cap, never fits the queue
    ({"stop": ["x"] * 17}, "stop", None),
    ({"stop": ["x" * 300]}, "stop", None),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids", None),
]
_BEST_OF = [({"best_of": 1000}, "best_of", None)]  # a completions field


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "base", "extra", "param", "code"),
    [(path, base, *case) for path, base in ROUTES for case in _NEVER]
    + [(*ROUTES[0], *case) for case in _BEST_OF],
)
def test_requests_that_can_never_run_get_400_naming_the_field(
    srv, path, base, stream, extra, param, code
):
    r = _post(srv, path, {**base, **extra, "stream": stream})
    err = _assert_error(r, 400, param)
    assert param in err["message"]
    if code is not None:
        assert err["code"] == code
    assert srv.engine.num_waiting() == 0  # nothing was counted for it


def test_the_openai_client_sees_the_n_cap(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="x", n=1_000_000, max_tokens=1)
    assert info.value.status_code == 400 and info.value.body["param"] == "n"


def test_a_full_queue_answers_503_with_retry_after_then_recovers(srv, llm):
    engine = srv.engine
    with ThreadPoolExecutor(1) as pool, engine_held(llm) as held:
        # one sequence enters the scheduler, then the loop stops at its step: queue 1/4
        first = pool.submit(_post, srv, ROUTES[0][0], {"prompt": "Hi", "max_tokens": 2})
        assert held.wait(TIMEOUT)
        assert engine.num_waiting() == 1
        for path, base in ROUTES:
            for stream in (False, True):
                # 1 + 4 > 4: could fit later, not now
                r = _post(srv, path, {**base, "n": QUEUE, "stream": stream})
                err = _assert_error(r, 503, None)
                assert err["code"] == "overloaded" and "retry later" in err["message"]
                assert 1 <= int(r.headers["retry-after"]) <= 60
                # more than the whole queue: never
                r = _post(srv, path, {**base, "n": QUEUE + 1, "stream": stream})
                _assert_error(r, 400, "n")
        assert engine.num_waiting() == 1  # refusals leave nothing counted
    assert first.result(TIMEOUT).status_code == 200
    r = _post(srv, ROUTES[1][0], {**ROUTES[1][1], "n": QUEUE})  # the whole queue: fits now
    assert r.status_code == 200 and len(r.json()["choices"]) == QUEUE
    assert engine.num_waiting() == 0
    assert _idle(llm)


def test_a_large_fan_out_does_not_starve_a_later_request(srv, llm):
    """8 sequences of one request and then 1 of another, 4 run at once: the later request
    takes the batch's second place (its turn comes after one sequence of the fan-out), so it
    finishes with the first wave, before the fan-out's second wave."""
    engine = srv.engine
    engine.max_waiting = 16
    done: dict[str, float] = {}

    def post(name: str, n: int) -> int:
        body = {"prompt": "Count to ten:", "n": n, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = _post(srv, "/v1/completions", body)
        done[name] = time.monotonic()
        return r.status_code

    try:
        with ThreadPoolExecutor(3) as pool:
            with engine_held(llm) as held:
                filler = pool.submit(post, "filler", 1)
                assert held.wait(TIMEOUT)
                big = pool.submit(post, "big", 8)
                deadline = time.monotonic() + TIMEOUT
                while engine.num_waiting() < 9:  # the fan-out is queued first
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                small = pool.submit(post, "small", 1)
                while engine.num_waiting() < 10:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            assert [f.result(TIMEOUT) for f in (filler, big, small)] == [200, 200, 200]
    finally:
        engine.max_waiting = QUEUE
    assert done["small"] < done["big"]
    assert _idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n=MAX_N + 1), "SamplingParams.n"),
        (dict(stop=["a"] * 17), "SamplingParams.stop"),
        (dict(stop=["a" * 257]), "SamplingParams.stop"),
        (dict(stop_token_ids=list(range(1025))), "SamplingParams.stop_token_ids"),
    ],
)
def test_sampling_params_refuse_the_same_with_the_field_named(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    SamplingParams(n=MAX_N, stop=["a" * 256] * 16, stop_token_ids=list(range(1024)))
