"""A mixed load that a server must survive: what the suite's soak test and
``benchmarks/soak.py`` send (issue #49's "no single client can take it down").

Each client thread loops until the deadline, one request at a time, drawing a kind: short
chats (some with ``n=2``) through the official ``openai`` client, streams read to the end,
long prompts, streams that hang up after two chunks, non-streamed requests whose client gives
up after a moment, malformed JSON, ``max_tokens: -1``, prompts over ``max_model_len`` and
``n: 1000000``. Every request has a timeout. Each ends as an `Outcome`: its HTTP status
(-1: the client hung up before any answer, or gave up after its timeout; -2: a broken
connection or stream; -3: a wrong answer) and whether that is what the kind expects; a 5xx
is never expected.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

#: kind -> weight of the draw
MIX = {
    "chat": 4,
    "chat_n2": 1,
    "stream": 3,
    "long_prompt": 1,
    "stream_hangup": 2,
    "plain_hangup": 1,
    "malformed_json": 1,
    "negative_max_tokens": 1,
    "overlong_prompt": 1,
    "huge_n": 1,
}
#: statuses each kind may end with (-1: hung up before an answer, by design)
EXPECTED = {
    "chat": {200},
    "chat_n2": {200},
    "stream": {200},
    "long_prompt": {200},
    "stream_hangup": {200},
    "plain_hangup": {-1, 200},
    "malformed_json": {400},
    "negative_max_tokens": {400},
    "overlong_prompt": {400},
    "huge_n": {400},
}
_TEXT = (
    "the engine keeps every key and value row of a request in host memory and copies the "
    "rows a decode step selects into a small buffer on the device before attention reads "
    "them so that long contexts fit where the device alone could not hold them"
)
_WORDS = _TEXT.split()


@dataclass
class Outcome:
    kind: str
    status: int
    #: `time.monotonic()` when it was sent and when it ended
    start: float
    end: float
    #: the request's chosen parameters' summary or the error seen
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def expected(self) -> bool:
        return self.status in EXPECTED[self.kind]


class MixedLoad:
    """``clients`` threads sending `MIX` to the server at ``url`` for ``seconds``.

    ``max_model_len``: the server's (the over-long prompt passes it); ``long_chars``: the
    size of a long prompt; ``max_tokens``: the largest output a request asks for;
    ``timeout``: seconds any one request may take before the client gives up (an outcome
    with status -1 and detail ``timeout``: a failure for any kind that expects an answer)."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        seconds: float,
        max_model_len: int,
        clients: int = 6,
        long_chars: int = 8000,
        max_tokens: int = 16,
        timeout: float = 120.0,
        seed: int = 0,
    ) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.seconds, self.clients = seconds, clients
        self.max_model_len, self.long_chars = max_model_len, long_chars
        self.max_tokens, self.timeout, self.seed = max_tokens, timeout, seed
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def run(self) -> list[Outcome]:
        """Send the load until the deadline and every client's last request ended."""
        deadline = time.monotonic() + self.seconds
        threads = [
            threading.Thread(target=self._client, args=(i, deadline), daemon=True)
            for i in range(self.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.seconds + 2 * self.timeout)
        return self.outcomes

    # --- one client ----------------------------------------------------------------------
    def _client(self, i: int, deadline: float) -> None:
        import httpx
        import openai

        rng = random.Random(self.seed * 1000 + i)
        kinds, weights = list(MIX), list(MIX.values())
        http = httpx.Client(base_url=self.url, timeout=self.timeout)
        oai = openai.OpenAI(
            base_url=self.url + "/v1",
            api_key="-",
            timeout=self.timeout,
            max_retries=0,
            http_client=httpx.Client(timeout=self.timeout),
        )
        try:
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                start = time.monotonic()
                try:
                    status, detail = getattr(self, "_" + kind)(rng, http, oai)
                except (httpx.TimeoutException, openai.APITimeoutError):
                    status, detail = -1, "timeout"
                except openai.APIStatusError as e:
                    status, detail = e.status_code, str(e.message)[:200]
                except (httpx.HTTPError, openai.APIConnectionError) as e:
                    status, detail = -2, f"{type(e).__name__}: {e}"[:200]
                with self._lock:
                    self.outcomes.append(Outcome(kind, status, start, time.monotonic(), detail))
        finally:
            http.close()
            oai.close()

    def _text(self, rng: random.Random, chars: int) -> str:
        words: list[str] = []
        n = 0
        while n < chars:
            w = rng.choice(_WORDS)
            words.append(w)
            n += len(w) + 1
        return " ".join(words)[:chars]

    def _tokens(self, rng: random.Random) -> int:
        return rng.randint(1, self.max_tokens)

    def _chat(self, rng, http, oai, n: int = 1) -> tuple[int, str]:
        question = f"In one sentence, what is {rng.randint(2, 99)} times {rng.randint(2, 99)}?"
        r = oai.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": question}],
            max_tokens=self._tokens(rng), n=n, temperature=rng.choice([0, 0.7]),
        )  # fmt: skip
        if len(r.choices) != n:
            return -3, f"{len(r.choices)} choices for n={n}"
        return 200, f"{r.usage.completion_tokens} tokens"

    def _chat_n2(self, rng, http, oai) -> tuple[int, str]:
        return self._chat(rng, http, oai, n=2)

    def _stream(self, rng, http, oai, hang_up: bool = False) -> tuple[int, str]:
        extra = 8 if hang_up else 0  # a stream that hangs up has more than 2 chunks to send
        body = dict(
            model=self.model,
            prompt=self._text(rng, 200),
            stream=True,
            max_tokens=self._tokens(rng) + extra,
            ignore_eos=hang_up,
        )
        events = 0
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text[:200]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if hang_up and events == 2:
                    return 200, "hung up after 2 chunks"
                if line.startswith('data: {"error"'):
                    return 500, line[:200]
                if line == "data: [DONE]":
                    return 200, f"{events} events"
        return -2, "the stream ended without [DONE]"

    def _stream_hangup(self, rng, http, oai) -> tuple[int, str]:
        return self._stream(rng, http, oai, hang_up=True)

    def _long_prompt(self, rng, http, oai) -> tuple[int, str]:
        body = dict(model=self.model, prompt=self._text(rng, self.long_chars),
                    max_tokens=self._tokens(rng))  # fmt: skip
        r = http.post("/v1/completions", json=body)
        return r.status_code, r.text[:200] if r.status_code != 200 else ""

    def _plain_hangup(self, rng, http, oai) -> tuple[int, str]:
        import httpx

        body = dict(model=self.model, prompt=self._text(rng, 200), max_tokens=self.max_tokens * 8,
                    ignore_eos=True)  # fmt: skip
        give_up = httpx.Timeout(self.timeout, read=rng.uniform(0.2, 1.0))
        try:
            r = http.post("/v1/completions", json=body, timeout=give_up)
        except httpx.ReadTimeout:
            return -1, "hung up"
        return r.status_code, "finished before the client gave up"

    def _bad(self, http, content: bytes | None = None, **body: Any) -> tuple[int, str]:
        if content is not None:
            r = http.post("/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})  # fmt: skip
        else:
            r = http.post("/v1/completions", json={"model": self.model, **body})
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
            "application/json") else {}  # fmt: skip
        return r.status_code, f"{err.get('param')}: {err.get('message', r.text)}"[:200]

    def _malformed_json(self, rng, http, oai) -> tuple[int, str]:
        return self._bad(http, content=b'{"model": "x", "prompt": "unterminated')

    def _negative_max_tokens(self, rng, http, oai) -> tuple[int, str]:
        return self._bad(http, prompt="hi", max_tokens=-1)

    def _overlong_prompt(self, rng, http, oai) -> tuple[int, str]:
        return self._bad(http, prompt=[5] * (self.max_model_len + 1), max_tokens=1)

    def _huge_n(self, rng, http, oai) -> tuple[int, str]:
        return self._bad(http, prompt="x", n=1_000_000)


def summary(outcomes: list[Outcome]) -> dict[str, Counter]:
    """Per kind, how many ended with each status."""
    out: dict[str, Counter] = {}
    for o in outcomes:
        out.setdefault(o.kind, Counter())[o.status] += 1
    return out


def rss_mib(pid: int | None = None) -> float:
    """Resident memory of process ``pid`` (this one by default), MiB (Linux)."""
    path = f"/proc/{pid or 'self'}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in {path}")
