"""``hisparse serve`` as a process (issue #49): its flags are checked and its port bound
before the model loads (a bad flag or a port in use fails at once, naming it); SIGTERM with
requests in flight aborts them (503, a stream's error event) and the process exits 0 within
5 s instead of waiting for every generation to end.

The server is started with ``--port 0`` (it prints the port it bound) on 127.0.0.1; every
request and every wait has a timeout, and the process is killed if a test fails."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
smollm2 = pytest.importorskip("hisparse.models.smollm2")
try:
    smollm2.smollm2_gguf_path()
except FileNotFoundError as err:  # pragma: no cover - `make test` installs it
    pytest.skip(str(err), allow_module_level=True)

TIMEOUT = 60.0
#: a model path that does not exist: a flag refused before the load names the flag, not this
MISSING = "/nonexistent/model.gguf"


def _serve(*flags: str) -> list[str]:
    return [sys.executable, "-m", "hisparse", "serve", "--device", "cpu", "--host", "127.0.0.1",
            "--max-model-len", "512", "--max-num-seqs", "4", "--gpu-memory-gib", "0.25",
            "--host-pool-gib", "0.25", "--log-level", "warning", *flags]  # fmt: skip


def test_a_bad_log_level_fails_before_the_model_loads():
    """The issue's case: it used to load the whole model, then die in uvicorn's KeyError."""
    r = subprocess.run(_serve("--model", MISSING, "--log-level", "verbose"), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--log-level" in r.stderr and "verbose" in r.stderr, r.stderr
    assert "nonexistent" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def _refused(capsys, *flags: str) -> str:
    """``hisparse serve`` (in this process) with ``flags`` on a missing model: it must exit 2
    before the model would load; its error message."""
    from hisparse.cli import main

    assert main(["serve", "--model", MISSING, "--host", "127.0.0.1", *flags]) == 2
    err = capsys.readouterr().err
    assert "nonexistent" not in err, err
    return err


def test_a_port_in_use_fails_before_the_model_loads(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _refused(capsys, "--port", str(port))
    assert f"--port {port}" in err and "cannot listen" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--port", "70000"), "--port"),
        (("--host", "203.0.113.7", "--port", "0"), "--host"),  # not an address of this machine
        (("--max-n", "129"), "--max-n"),
        (("--max-waiting", "0"), "--max-waiting"),
        (("--request-timeout", "-1"), "--request-timeout"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(capsys, flags, named):
    assert named in _refused(capsys, *flags)


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_sigterm_aborts_requests_in_flight_and_exits_within_5_s():
    proc = subprocess.Popen(
        _serve("--model", "smollm2", "--port", "0", "--offload", "always"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + 180
        port = None
        while port is None:
            assert proc.poll() is None, proc.stderr.read()
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                pytest.fail("the server did not start within 180 s")
            if m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", line):
                port = int(m.group(1))
        url = f"http://127.0.0.1:{port}"
        long = {"model": "smollm2", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        results: dict[str, object] = {}

        def plain() -> None:
            body = {**long, "prompt": "Tell me a long story."}
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)

        def streamed() -> None:
            body = {**long, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            events = []
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=TIMEOUT) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            results["stream"] = events

        clients = [threading.Thread(target=f, daemon=True) for f in (plain, streamed)]
        for t in clients:
            t.start()
        running = re.compile(r"^hisparse:num_requests_running\{[^}]*\} (\S+)$", re.M)
        while True:
            m = running.search(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
            if m and float(m.group(1)) == 2:
                break
            assert time.monotonic() < deadline + TIMEOUT, "the requests did not start"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in clients:
            t.join(TIMEOUT)
        stderr = proc.stderr.read()
        assert code == 0, stderr
        assert took < 5, f"exited {took:.1f} s after SIGTERM"
        assert "Traceback" not in stderr, stderr
        r = results["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        events = results["stream"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
